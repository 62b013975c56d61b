"""Adaptive drafter: the online buffer fed by the RL step's own forward, and the refresh policy.

TLT mechanism 2: the drafter keeps learning from the freshest rollouts. Its data are the target
hidden states of the old-log-prob forward (no extra pass); the buffer keeps the last
`buffer_steps` RL steps (one-step offset: the previous step's long responses stay in).
"""
from __future__ import annotations

import time
import torch

from tlt.drafter.buffer import DraftBuffer
from tlt.drafter.train import DrafterTrainer, prompt_weight
from tlt.faults import fault


def refresh_due(cfg, step: int, last_accept: float | None) -> bool:
    """Whether RL step `step` refreshes the drafter (both refreshers: the spot trainer in that
    step's rollout tail, the sequential one after its update): every `refresh_every` steps
    (steps k-1, 2k-1, ...), or when the last rollout's accept length fell under
    `refresh_below_accept_len`. refresh_every 0 with no bound: never (frozen)."""
    every = cfg.refresh_every
    if every and (step + 1) % every == 0:
        return True
    low = cfg.refresh_below_accept_len
    return low is not None and last_accept is not None and last_accept < low


class DrafterRefresher:
    """Owns the drafter's buffer and trainer; decides when to refresh and runs the refresh."""

    def __init__(self, trainer: DrafterTrainer, cfg, seed: int = 0):
        self.trainer, self.cfg = trainer, cfg
        self.drafter = trainer.drafter
        self.buffer = DraftBuffer(cfg.buffer_steps, cfg.buffer_max_tokens, prompt_weight(cfg))
        self.rng = torch.Generator().manual_seed(seed)
        self.last_accept: float | None = None
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

    def after_update(self, step: int, accept_len: float | None) -> dict[str, float]:
        """Sequential refresh after the policy update, when due."""
        self.observe(accept_len)
        return self.refresh(step) if self.due(step) else {}

    def optimizer_state(self) -> dict:
        return {"optimizer": self.trainer.opt.state_dict(), "num_steps": self.trainer.num_steps}

    def load(self, drafter_state: dict, optim_state: dict | None) -> None:
        self.drafter.load_state_dict(drafter_state, strict=True)
        if optim_state is not None:
            self.trainer.opt.load_state_dict(optim_state["optimizer"])
            self.trainer.num_steps = optim_state["num_steps"]

    def close(self) -> None:
        pass

    def observe(self, accept_len: float | None) -> None:
        """The rollout's measured accept length (spec/accept_len/mean), for the below-threshold trigger."""
        if accept_len is not None:
            self.last_accept = accept_len

    def due(self, step: int) -> bool:
        return refresh_due(self.cfg, step, self.last_accept)

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
        return metrics
