"""Engine-level counters of one rollout (`RolloutBatch.stats`), typed.

Filled by the torch engine (engine.py, spec.py), rebuilt from a vLLM worker's counters
(vllm_engine/backend.py), combined over shards with `merge` (workers.py), read by `tlt.metrics`.
The derived properties are the ratios `tlt.metrics.rollout_metrics` logs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Counters that add up when shards (or calls) are combined.
SUMMED = ("prefill_s", "decode_steps", "spec_steps", "tuner_plain_steps", "spec_row_passes", "spec_tokens",
          "ngram_row_passes", "ngram_tokens", "target_forwards", "tokens", "workers")


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class RolloutStats:
    """Counters of one `generate` call.

    time_s: wall clock; tail_time_s: time with <= spec_threshold rows running; spec_row_passes /
    spec_tokens: rows verified / tokens emitted by speculative rounds (ngram_*: the n-gram rounds
    among them); target_forwards: batched target forwards; tokens: response tokens.
    accepted_pos[i] / drafted_pos[i]: rounds accepted down to / drafting depth i+1.
    strategy: bucket -> arm index -> rounds played (tuner on; string keys, JSON-friendly).
    worker_idle_s: worker-seconds spent waiting for the slowest shard (sharded rollout only);
    workers: engines whose counters are in here; vllm: the vLLM worker's own counters (vLLM only).
    guard_tripped: batch-size tiers whose SD the spec guard has switched off (tlt.rollout.guard;
    None: SD was not asked for). regret: bucket -> the bandit's cumulative regret in seconds after
    this call (tlt.rollout.tuner; None: no bandit); shards' add up.
    """
    time_s: float = 0.0
    prefill_s: float = 0.0
    tail_time_s: float = 0.0
    decode_steps: int = 0
    spec_steps: int = 0
    tuner_plain_steps: int = 0
    spec_row_passes: int = 0
    spec_tokens: int = 0
    ngram_row_passes: int = 0
    ngram_tokens: int = 0
    target_forwards: int = 0
    tokens: int = 0
    accepted_pos: list[int] = field(default_factory=list)
    drafted_pos: list[int] = field(default_factory=list)
    strategy: dict[str, dict[str, int]] = field(default_factory=dict)
    worker_idle_s: float | None = None
    workers: int = 1
    vllm: dict | None = None
    guard_tripped: int | None = None
    regret: dict[str, float] | None = None

    # ---- recording (torch engine) ----------------------------------------------------------
    def count_positions(self, drafted_depth: torch.Tensor, n_acc: torch.Tensor) -> None:
        """drafted_depth [B] deepest draft per row, n_acc [B] accepted: per-position counters."""
        dmax = int(drafted_depth.max()) if drafted_depth.numel() else 0
        for lst, vals in ((self.drafted_pos, drafted_depth), (self.accepted_pos, n_acc)):
            lst.extend([0] * (dmax - len(lst)))
            for i in range(dmax):
                lst[i] += int((vals > i).sum())

    def record_strategy(self, bucket: int, arm: int) -> None:
        per = self.strategy.setdefault(str(bucket), {})
        per[str(arm)] = per.get(str(arm), 0) + 1

    # ---- combining -------------------------------------------------------------------------
    def merge(self, other: "RolloutStats") -> "RolloutStats":
        """Counters of two concurrent rollouts (shards): `SUMMED` and the position and strategy
        counters add up; `time_s` and `tail_time_s` are the longer of the two (the shards ran at
        the same time); `worker_idle_s` adds up when either has one; `guard_tripped` is the larger. `vllm` is not combined."""
        out = RolloutStats(**{k: getattr(self, k) + getattr(other, k) for k in SUMMED})
        out.time_s, out.tail_time_s = max(self.time_s, other.time_s), max(self.tail_time_s, other.tail_time_s)
        out.accepted_pos = _add_lists(self.accepted_pos, other.accepted_pos)
        out.drafted_pos = _add_lists(self.drafted_pos, other.drafted_pos)
        for src in (self.strategy, other.strategy):
            for bucket, arms in src.items():
                per = out.strategy.setdefault(bucket, {})
                for arm, n in arms.items():
                    per[arm] = per.get(arm, 0) + n
        tripped = [t for t in (self.guard_tripped, other.guard_tripped) if t is not None]
        out.guard_tripped = max(tripped) if tripped else None
        if self.regret is not None or other.regret is not None:
            keys = {**(self.regret or {}), **(other.regret or {})}
            out.regret = {k: (self.regret or {}).get(k, 0.0) + (other.regret or {}).get(k, 0.0) for k in keys}
        if self.worker_idle_s is not None or other.worker_idle_s is not None:
            out.worker_idle_s = (self.worker_idle_s or 0.0) + (other.worker_idle_s or 0.0)
        return out

    # ---- derived (the ratios tlt.metrics logs) ---------------------------------------------
    @property
    def accept_len(self) -> float | None:
        """Tokens per row verify pass during SD; None when SD never ran."""
        return self.spec_tokens / self.spec_row_passes if self.spec_row_passes else None

    @property
    def enabled_share(self) -> float:
        """Share of the response tokens emitted by SD rounds."""
        return self.spec_tokens / self.tokens if self.tokens else 0.0

    @property
    def ngram_share(self) -> float:
        """Share of the SD tokens emitted by n-gram rounds."""
        return self.ngram_tokens / max(1, self.spec_tokens)

    @property
    def ngram_accept_len(self) -> float | None:
        return self.ngram_tokens / self.ngram_row_passes if self.ngram_row_passes else None

    @property
    def tail_share(self) -> float:
        return self.tail_time_s / self.time_s if self.time_s > 0 else 0.0

    @property
    def accept_rate_by_pos(self) -> dict[int, float]:
        """Position i -> share of rounds drafting depth i+1 accepted down to it (drafted ones only)."""
        return {i: a / d for i, (a, d) in enumerate(zip(self.accepted_pos, self.drafted_pos)) if d}

    @property
    def top_strategy(self) -> dict[str, int]:
        """Bucket -> the arm played most often there (ties: the lower arm index)."""
        return {b: int(max(c, key=lambda k: (c[k], -int(k)))) for b, c in self.strategy.items()}

