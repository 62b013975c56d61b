"""Adaptive drafter: the online buffer fed by the RL step's own forward, and the refresh policy.

TLT mechanism 2: the drafter keeps learning from the freshest rollouts. Its data are the target
hidden states of the old-log-prob forward (no extra pass); the buffer keeps the last
`buffer_steps` RL steps (one-step offset: the previous step's long responses stay in).
"""
from __future__ import annotations

import os
import time

import torch

from tlt.drafter.buffer import DraftBuffer
from tlt.drafter.schedule import RefreshSchedule
from tlt.drafter.train import DrafterTrainer, prompt_weight
from tlt.faults import fault
from tlt.versions import bump


class DrafterRefresher:
    """Owns the drafter's buffer and trainer; asks its `RefreshSchedule` when to refresh and runs
    `refresh_steps` drafter steps after the policy update (`drafter.where: sequential`)."""

    def __init__(self, trainer: DrafterTrainer, cfg, seed: int = 0):
        self.trainer, self.cfg = trainer, cfg
        self.drafter = trainer.drafter
        self.buffer = DraftBuffer(cfg.buffer_steps, cfg.buffer_max_tokens, prompt_weight(cfg))
        self.rng = torch.Generator().manual_seed(seed)
        self.schedule = RefreshSchedule(cfg, cpus=os.cpu_count() or 1)
        self.total_steps = 0

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.drafter.aux_layer_ids

    def add_rollouts(self, step: int, ids, attn, resp, aux, last_hidden) -> None:
        """Rows of the old-log-prob forward [B,T,...] (right padded) -> buffer samples."""
        self.buffer.add_rows(step, ids, attn, resp, aux, last_hidden)

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
        buffer, buffer_meta = self.buffer.state_dict()
        return {"drafter": self.drafter.state_dict(), "optimizer": self.trainer.opt.state_dict(),
                "num_steps": self.trainer.num_steps, "buffer": buffer, "buffer_meta": buffer_meta,
                "rng": self.rng.get_state(), "total_steps": self.total_steps, "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.drafter.load_state_dict(state["drafter"], strict=True)
        bump(self.drafter)
        self.trainer.opt.load_state_dict(state["optimizer"])
        self.trainer.num_steps = state["num_steps"]
        self.buffer.load_state_dict(state["buffer"], state["buffer_meta"])
        self.rng.set_state(state["rng"])
        self.total_steps = state["total_steps"]
        self.schedule.load_state_dict(state["schedule"])

    def close(self) -> None:
        pass

    def refresh(self, step: int) -> dict[str, float]:
        """`refresh_steps` drafter updates on the buffer (accept length is measured by the next rollout)."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        history = []
        batches = self.buffer.batches(self.cfg.batch_tokens, self.rng)
        for i in range(self.cfg.refresh_steps):
            if not batches:
                break
            history.append(self.trainer.step(batches[i % len(batches)]))
            fault("refresh", step)  # crash tests: SIGKILL with the drafter half refreshed
        for key in ("drafter/loss", "drafter/loss_feature", "drafter/loss_token", "drafter/top1_acc"):
            vals = [h[key] for h in history if key in h]
            if vals:
                metrics[key] = sum(vals) / len(vals)
        self.total_steps += len(history)
        metrics["drafter/steps"] = float(self.total_steps)
        metrics["drafter/buffer_tokens"] = float(self.buffer.num_tokens)
        metrics["drafter/train_s"] = time.perf_counter() - t0
        self.schedule.measured_refresh(len(history), metrics["drafter/train_s"])
        return metrics
