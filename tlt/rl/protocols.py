"""The written contracts of the parts an RL step drives besides the rollout engine (whose contract,
`Engine`, lives with the engines: tlt.rollout.contract): the drafter `Refresher` and the policy
`Updater`.

A Protocol lists behaviour (methods and read-only properties) only; state goes in and out through
`state_dict()` / `load_state_dict()`. tests/test_protocols.py checks every implementation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tlt.rollout.contract import TailHook

if TYPE_CHECKING:
    from tlt.rl.update import OnForward, PolicyBatch

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
