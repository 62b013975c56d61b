"""Guard against silent draft loss: a drafter that an engine lost or mangled turns SD into a slowdown
that nothing else notices (the output stays correct: SD is lossless).

Two checks, used by every engine:

  - `probe_*`: after a drafter is loaded into an engine that keeps its own copy (vLLM), the copy's
    logits on a fixed probe must match the trained drafter's. The probe is `PROBE_ROWS` single-token
    inputs (random aux features, token ids from the draft vocabulary, position 0), so each row attends
    only to itself and the check needs no KV cache: every weight of the drafter (fc, the layer's
    norms, attention projections, MLP, final norm, LM head, vocabulary map) and the shared target
    embedding goes through the engine's own compute path. A mismatch raises `DrafterMismatch`: the
    engine's drafter is not the exported one (a corrupt or stale export, a reload that did not reach
    the packed weights), which is a fault to fix, not a condition to run through.
  - `SpecGuard`: at run time, per batch-size tier (`rollout.tuner_buckets`), the accept length of a
    rollout's speculative rounds is compared with the tier's break-even accept length, measured in
    the same rollout: the mean time of an SD round in the tier over the mean time of a plain decode
    step (a plain step emits one token per row, a round `accept length` tokens, so SD pays only above
    that ratio). The plain steps run at larger batches than the tail, so they cost at least as much as
    a plain step in the tier would: the estimate errs towards keeping SD on. A tier below break-even
    for `rollout.guard_patience` consecutive rollouts has SD switched off (`spec/guard_tripped` counts
    the tiers off); a new drafter re-arms every tier.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

PROBE_ROWS = 8
# Relative L2 error of the probe logits (engine vs trained drafter) allowed per engine dtype: fp32
# engines agree to ~1e-6 (different GEMM kernels), bf16/fp16 to ~1e-2 (rounding through five layers);
# a drafter that differs by more than the tolerance (a weight scaled, zeroed or left stale by more
# than ~0.1 % in fp32, ~5 % in bf16) fails.
PROBE_TOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 2e-2}


class DrafterMismatch(RuntimeError):
    """The engine's drafter computes other logits than the drafter that was exported to it."""


def probe_inputs(drafter, rows: int = PROBE_ROWS, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed probe: aux [rows, 3H] (standard normal) and token ids [rows] of the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(rows, 3 * drafter.hidden_size, generator=g)
    slots = torch.randint(0, drafter.draft_vocab_size, (rows,), generator=g)
    return {"aux": aux, "ids": drafter.draft_to_target_ids().cpu()[slots].long()}


@torch.no_grad()
def probe_logits(drafter, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """The drafter's logits [rows, Vd] on the probe: each row one token at position 0."""
    dev = drafter.fc.weight.device
    aux, ids = probe["aux"].to(dev)[:, None], probe["ids"].to(dev)[:, None]
    _, logits, _ = drafter(ids, drafter.fuse(aux), torch.zeros_like(ids))
    return logits[:, 0].float().cpu()


def probe_error(expected: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(relative L2 error, share of rows whose top-1 draft agrees)."""
    err = float((got.float() - expected).norm() / expected.norm().clamp_min(1e-12))
    return err, float((got.argmax(-1) == expected.argmax(-1)).float().mean())


def check_probe(expected: torch.Tensor, got: torch.Tensor, dtype: str, where: str) -> dict[str, float]:
    """Raise `DrafterMismatch` unless `got` matches `expected` within the dtype's tolerance."""
    if tuple(got.shape) != tuple(expected.shape):
        raise DrafterMismatch(f"{where}: the engine's drafter gives logits of shape {tuple(got.shape)} on the "
                              f"probe, the exported drafter {tuple(expected.shape)}")
    err, top1 = probe_error(expected, got)
    tol = PROBE_TOL.get(dtype, PROBE_TOL["bfloat16"])
    if not err <= tol:  # also NaN
        raise DrafterMismatch(
            f"{where}: the engine's drafter is not the one just exported: its logits on the probe differ from "
            f"the trained drafter's by {err:.3g} (relative L2; tolerance {tol:g} in {dtype}), top-1 agrees on "
            f"{top1:.0%} of the probe rows. Speculation with it would only slow the rollout down. Check the "
            "export (a corrupt or stale model.safetensors) and the engine's reload path.")
    return {"spec/probe_error": err, "spec/probe_top1": top1}


@dataclass
class TierSteps:
    """What one rollout did in one batch-size tier: SD rounds (count, seconds, row passes, tokens)."""

    rounds: int = 0
    round_s: float = 0.0
    row_passes: int = 0
    tokens: int = 0

    def add(self, dt: float, row_passes: int, tokens: int) -> None:
        self.rounds += 1
        self.round_s += dt
        self.row_passes += row_passes
        self.tokens += tokens


@dataclass
class StepLog:
    """A rollout's step timings for the guard: plain decode steps, and SD rounds per tier."""

    plain_steps: int = 0
    plain_s: float = 0.0
    tiers: dict[int, TierSteps] = field(default_factory=dict)

    def plain(self, dt: float) -> None:
        self.plain_steps += 1
        self.plain_s += dt

    def spec(self, tier: int, dt: float, row_passes: int, tokens: int) -> None:
        self.tiers.setdefault(tier, TierSteps()).add(dt, row_passes, tokens)


class SpecGuard:
    """Per-tier SD switch-off after `patience` consecutive rollouts below break-even (0: never)."""

    def __init__(self, buckets: list[int], patience: int):
        self.buckets, self.patience = sorted(buckets), int(patience)
        self.below = [0] * len(self.buckets)
        self.off = [False] * len(self.buckets)
        self.last: dict[int, tuple[float, float]] = {}  # tier -> (accept length, break-even) of the last rollout

    @classmethod
    def from_config(cls, r) -> "SpecGuard":
        return cls(r.tuner_buckets, r.guard_patience)

    def tier_of(self, batch_size: int) -> int:
        """Index of the tier with the largest lower bound <= batch_size (as StrategyTuner.bucket_of)."""
        return max([i for i, low in enumerate(self.buckets) if batch_size >= low], default=0)

    def tier_name(self, tier: int) -> str:
        """Batch sizes of a tier, e.g. '2-4' or '21+'."""
        low = self.buckets[tier]
        return f"{low}+" if tier == len(self.buckets) - 1 else f"{low}-{self.buckets[tier + 1] - 1}"

    def allows(self, batch_size: int) -> bool:
        return not self.off[self.tier_of(batch_size)]

    @property
    def tripped(self) -> int:
        return sum(self.off)

    def rearm(self) -> None:
        """A new drafter: every tier may speculate again."""
        self.below = [0] * len(self.buckets)
        self.off = [False] * len(self.buckets)

    def observe(self, log: StepLog) -> int:
        """One rollout's steps; returns the number of tiers with SD off afterwards."""
        if self.patience <= 0 or log.plain_steps == 0:
            return self.tripped  # no plain step to price a round against: no verdict
        plain = log.plain_s / log.plain_steps
        for tier, t in log.tiers.items():
            if not t.rounds or not t.row_passes:
                continue
            accept, break_even = t.tokens / t.row_passes, (t.round_s / t.rounds) / plain
            self.last[tier] = (accept, break_even)
            self.below[tier] = self.below[tier] + 1 if accept < break_even else 0
            if self.below[tier] >= self.patience and not self.off[tier]:
                self.off[tier] = True
                warnings.warn(f"spec guard: batch sizes {self.tier_name(tier)} accepted {accept:.2f} tokens per "
                              f"round for {self.below[tier]} rollouts, under the break-even {break_even:.2f} "
                              "(round time / plain step time): SD off there until the drafter changes",
                              stacklevel=2)
        return self.tripped
