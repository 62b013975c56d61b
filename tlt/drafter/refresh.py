"""Sequential drafter refresh: `refresh_steps` drafter steps after the policy update, when the schedule says so.

TLT mechanism 2: the drafter keeps learning from the freshest rollouts. Its data are the target
hidden states of the old-log-prob forward (no extra pass); the buffer (tlt.drafter.online) keeps
the last `buffer_steps` RL steps (one-step offset: the previous step's long responses stay in).
"""
from __future__ import annotations

import os
import time

from tlt.drafter.online import OnlineRefresher, mean_losses
from tlt.drafter.train import DrafterTrainer
from tlt.faults import fault
from tlt.versions import write_weights


class DrafterRefresher(OnlineRefresher):
    """Owns the drafter's trainer; asks its `RefreshSchedule` when to refresh and runs
    `refresh_steps` drafter steps after the policy update (`drafter.where: sequential`)."""

    def __init__(self, trainer: DrafterTrainer, cfg, seed: int = 0):
        super().__init__(trainer.drafter, cfg, seed, cpus=os.cpu_count() or 1)
        self.trainer = trainer

    # ---- hooks called by the RL step (the `Refresher` protocol of tlt.rl.step) ---------------
    def before_rollout(self, step: int) -> None:
        """No tail hook: this refresher trains after the policy update, not during the rollout."""
        return None

    def after_rollout(self) -> dict[str, float]:
        return {}

    def after_update(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics so far go to the schedule; a due refresh runs now, after the update."""
        self.schedule.observe(step, metrics)
        out = self.refresh(step) if self.schedule.due(step) else {}
        return {**out, **self.schedule.metrics()}

    def state_dict(self) -> dict:
        """Drafter weights, optimizer, buffer, RNG, step count and schedule: what a resumed run needs."""
        return {"drafter": self.drafter.state_dict(), "optimizer": self.trainer.opt.state_dict(),
                "num_steps": self.trainer.num_steps, **self.online_state()}

    def load_state_dict(self, state: dict) -> None:
        write_weights(self.drafter, state["drafter"])
        self.trainer.opt.load_state_dict(state["optimizer"])
        self.trainer.num_steps = state["num_steps"]
        self.load_online_state(state)

    def refresh(self, step: int) -> dict[str, float]:
        """`refresh_steps` drafter updates on the buffer (accept length is measured by the next rollout)."""
        t0 = time.perf_counter()
        history = []
        batches = self.buffer.batches(self.cfg.batch_tokens, self.rng)
        for i in range(self.cfg.refresh_steps):
            if not batches:
                break
            history.append(self.trainer.step(batches[i % len(batches)]))
            fault("refresh", step)  # crash tests: SIGKILL with the drafter half refreshed
        metrics = mean_losses(history)
        self.total_steps += len(history)
        metrics["drafter/steps"] = float(self.total_steps)
        metrics["drafter/buffer_tokens"] = float(self.buffer.num_tokens)
        metrics["drafter/train_s"] = time.perf_counter() - t0
        self.schedule.measured_refresh(len(history), metrics["drafter/train_s"])
        return metrics
