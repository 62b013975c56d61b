"""The written contracts of the parts an RL step drives: the rollout `Engine`, the drafter
`Refresher` and the policy `Updater`.

A Protocol lists behaviour (methods) only, plus the engine's three read-outs that the
checkpoint and the held-out accept-length measurement swap; state goes in and out through
`state_dict()` / `load_state_dict()`. tests/test_protocols.py checks every implementation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tlt.config import RolloutConfig
    from tlt.rl.update import OnForward, PolicyBatch
    from tlt.rollout.ngram import PromptHistory
    from tlt.rollout.state import RolloutBatch
    from tlt.rollout.tuner import StrategyTuner

TailHook = Callable[[int], None]  # called with the number of running sequences when the rollout's tail starts


@runtime_checkable
class Engine(Protocol):
    """What an RL step and a checkpoint need of a rollout engine: tlt.rollout.engine.RolloutEngine
    (this process), tlt.rollout.workers.WorkerPool (CPU worker processes), or
    tlt.rollout.vllm_backend.VllmRolloutEngine (a vLLM worker process)."""

    cfg: RolloutConfig
    tuner: StrategyTuner | None  # None: no per-batch-size bandit in this process
    history: PromptHistory | None  # None: no n-gram drafts from earlier answers

    def generate(self, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 spec: bool | None = None, spec_threshold: int | None = None,
                 on_tail: TailHook | None = None) -> RolloutBatch: ...

    def sync(self, model=None) -> dict[str, float]:
        """Make the engine decode with `model`'s current weights (a no-op in this process)."""

    def sleep(self) -> dict[str, float]:
        """Before the policy update: hand the engine's accelerator memory to it (vLLM sleep mode;
        the `sync` after the update wakes the engine). {} where there is nothing to hand over."""


@runtime_checkable
class Refresher(Protocol):
    """The adaptive drafter as the RL step drives it: tlt.drafter.refresh.DrafterRefresher
    (sequential refresh after the update) or tlt.drafter.spot.SpotTrainer (in the rollout's tail)."""

    @property
    def aux_layer_ids(self) -> list[int]: ...

    def add_rollouts(self, step: int, ids, attn, resp, aux, last_hidden) -> None: ...

    def before_rollout(self, step: int) -> TailHook | None:
        """Before step `step`'s rollout; returns the `on_tail` hook for `Engine.generate` (None: none)."""

    def after_rollout(self) -> dict[str, float]: ...

    def after_update(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """After the policy update, with the step's metrics so far (its schedule observes them)."""

    def state_dict(self) -> dict:
        """Everything a resumed run needs ("drafter": its trainable weights, and the rest)."""

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Updater(Protocol):
    """The policy update as the RL step drives it: tlt.rl.update.TorchUpdater (plain torch),
    tlt.rl.update.DeepSpeedUpdater (ZeRO 0-2, this process) or
    tlt.cluster.trainer_ranks.RayDeepSpeedUpdater (data-parallel ranks on Ray)."""

    def step(self, batch: PolicyBatch, aux_layer_ids: list[int] | None = None,
             on_forward: OnForward | None = None) -> dict[str, float]:
        """One optimizer step on the whole batch -> policy/* metrics; `on_forward` sees every
        micro-batch's forward (the drafter's features), with the hidden states at `aux_layer_ids`."""

    def state_dict(self) -> dict:
        """The optimizer state a resumed run needs."""

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None:
        """Release what the backend started (process groups, ranks); idempotent."""
