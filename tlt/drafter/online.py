"""What both drafter refreshers share (TLT mechanism 2): the online buffer fed by the RL step's own
forward, the shuffle RNG, the refresh schedule and the step count, with their checkpoint state.

The sequential refresher (tlt.drafter.refresh: drafter steps after the policy update) and the spot
trainer (tlt.drafter.spot: drafter steps in the rollout's idle tail, in a process of its own)
extend `OnlineRefresher`; they differ only in where and when the drafter steps run.
"""
from __future__ import annotations

import torch

from tlt.drafter.buffer import DraftBuffer
from tlt.drafter.schedule import RefreshSchedule
from tlt.drafter.train import prompt_weight

LOSS_METRICS = ("drafter/loss", "drafter/loss_feature", "drafter/loss_token", "drafter/top1_acc")


def mean_losses(history: list[dict[str, float]]) -> dict[str, float]:
    """The drafter steps' loss metrics averaged over the steps that reported them."""
    out = {}
    for key in LOSS_METRICS:
        vals = [h[key] for h in history if key in h]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


class OnlineRefresher:
    """The buffer, RNG, schedule and step count of a drafter refresher. `cpus`: the cores the
    schedule may count as idle in the tail (0 where decoding does not share the drafter's cores)."""

    def __init__(self, drafter, cfg, seed: int, cpus: int):
        self.drafter, self.cfg = drafter, cfg
        self.buffer = DraftBuffer(cfg.buffer_steps, cfg.buffer_max_tokens, prompt_weight(cfg))
        self.rng = torch.Generator().manual_seed(seed)  # shuffle seeds for the buffer's batches (CPU)
        self.schedule = RefreshSchedule(cfg, cpus=cpus)
        self.total_steps = 0

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.drafter.aux_layer_ids

    def add_rollouts(self, step: int, ids, attn, resp, aux, last_hidden) -> None:
        """Rows of the old-log-prob forward [B,T,...] (right padded) -> buffer samples."""
        self.buffer.add_rows(step, ids, attn, resp, aux, last_hidden)

    def online_state(self) -> dict:
        """Buffer, RNG, step count and schedule: the refresher's part of a resumable checkpoint."""
        buffer, buffer_meta = self.buffer.state_dict()
        return {"buffer": buffer, "buffer_meta": buffer_meta, "rng": self.rng.get_state(),
                "total_steps": self.total_steps, "schedule": self.schedule.state_dict()}

    def load_online_state(self, state: dict) -> None:
        self.buffer.load_state_dict(state["buffer"], state["buffer_meta"])
        self.rng.set_state(state["rng"])
        self.total_steps = state["total_steps"]
        self.schedule.load_state_dict(state["schedule"])

    def close(self) -> None:
        """Nothing to stop here; the spot trainer stops its process."""
