"""The written contracts of the parts an RL step drives: the rollout `Engine`, the drafter
`Refresher` and the policy `Updater`.

A Protocol lists behaviour (methods and read-only properties) only; state goes in and out through
`state_dict()` / `load_state_dict()`. tests/test_protocols.py checks every implementation.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tlt.config import SpecStrategy
    from tlt.rl.update import OnForward, PolicyBatch
    from tlt.rollout.capabilities import Capabilities
    from tlt.rollout.state import RolloutBatch

TailHook = Callable[[int], None]  # called with the number of running sequences when the rollout's tail starts


@runtime_checkable
class Engine(Protocol):
    """What an RL step, an evaluation and a checkpoint need of a rollout engine:
    tlt.rollout.engine.RolloutEngine (this process), tlt.rollout.workers.WorkerPool (CPU worker
    processes), tlt.rollout.vllm_backend.VllmRolloutEngine (a vLLM worker process) or
    tlt.cluster.rollout_actor.RayRolloutPool (Ray actors).

    Per-call options go with the call (`generate`'s arguments, `fixed_strategy`'s block); what the
    engine supports is in `capabilities`, and a call it cannot honour raises
    `tlt.rollout.capabilities.EngineCapabilityError` with the reason instead of decoding some
    other way. Callers never read or set an engine's config, bandit or prompt history."""

    def generate(self, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 spec: bool | None = None, spec_threshold: int | None = None,
                 on_tail: TailHook | None = None) -> RolloutBatch:
        """`group_size` responses per prompt, group-major. spec / spec_threshold: this call's SD on/off
        and tail threshold (None: the config's); on_tail: called once when the rollout's tail starts."""

    def sync(self, model=None) -> dict[str, float]:
        """Make the engine decode with `model`'s current weights (a no-op in this process)."""

    def sleep(self) -> dict[str, float]:
        """Before the policy update: hand the engine's accelerator memory to it (vLLM sleep mode;
        the `sync` after the update wakes the engine). {} where there is nothing to hand over."""

    @property
    def capabilities(self) -> Capabilities:
        """What this engine supports (tlt.rollout.capabilities.Capabilities): per-call SD, the tail
        switch, a bandit, tree strategies, draft sources and depth, lossless sampled SD, ..."""

    def state_dict(self) -> dict:
        """What a run checkpoint keeps of the engine ({"tuner": the bandit's state} where the engine
        holds one in this process; {} where there is nothing, e.g. pools whose workers keep their own)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output (keys the engine does not hold are ignored)."""

    def fixed_strategy(self, strategy: SpecStrategy, batch_size: int = 8) -> AbstractContextManager[None]:
        """A block in which every `generate` of up to `batch_size` prompts speculates with `strategy` on
        every step (bandit, spec guard, patience and pruning off, no earlier answers); the engine is as
        before afterwards. Used by tlt.rollout.engine.measure_accept (the held-out accept length).
        EngineCapabilityError where the engine cannot (a pool; a strategy it cannot run)."""


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
