"""Online calibration of the drafter's confidence, for chains that stop where drafting stops paying.

`Calibrator` keeps, per draft depth and per bin of the drafter's probability of its own draft,
how often the target accepted that draft (given everything before it was accepted). A chain
keeps drafting while the calibrated probability that the next draft is accepted *and all before
it* stays above `rollout.draft_stop_below`: on a CPU a verified token costs ~0.14 of a decode
step (the CPU cost curve: a verify of M tokens ~ 40 ms + 6.25 ms * M on 2 cores), so a draft with a lower chance of being used costs more than it
is expected to save. Estimates start from the raw probability (2 pseudo-counts per bin) and
follow what verification observes. Drafting never changes what the target emits (lossless).
"""
from __future__ import annotations

import torch


class Calibrator:
    """acceptance(depth, prob) -> calibrated P(accept | accepted so far); update() from verify results."""

    def __init__(self, max_depth: int = 16, bins: int = 10, prior: float = 2.0):
        centers = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        self.bins = bins
        self.acc = (centers * prior).expand(max_depth, bins).clone()
        self.n = torch.full((max_depth, bins), float(prior), dtype=torch.float64)

    def _bin(self, prob: torch.Tensor) -> torch.Tensor:
        return (prob.detach().double().cpu() * self.bins).long().clamp(0, self.bins - 1)

    def acceptance(self, depth: int, prob: torch.Tensor) -> torch.Tensor:
        """prob [B] drafter probability of the depth-`depth` draft (0-based) -> [B] estimate."""
        d = min(depth, self.acc.shape[0] - 1)
        b = self._bin(prob)
        return (self.acc[d, b] / self.n[d, b]).to(prob.device, torch.float32)

    def update(self, prob: torch.Tensor, valid: torch.Tensor, n_acc: torch.Tensor) -> None:
        """prob/valid [B,D] of a verified chain, n_acc [B] drafts accepted: draft j was observed
        iff j <= n_acc (all before it accepted) and accepted iff j < n_acc."""
        prob, valid, n_acc = prob.cpu(), valid.cpu(), n_acc.cpu()
        for j in range(min(prob.shape[1], self.acc.shape[0])):
            seen = valid[:, j] & (n_acc >= j)
            if not bool(seen.any()):
                break
            b = self._bin(prob[seen, j])
            self.n[j].index_add_(0, b, torch.ones(b.shape[0], dtype=torch.float64))
            self.acc[j].index_add_(0, b, (n_acc[seen] > j).double())

    def table(self) -> list[list[float]]:
        """Calibrated acceptance per depth x bin (for reports)."""
        return (self.acc / self.n).tolist()
