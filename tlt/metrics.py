"""Rollout and speculative-decoding metrics as pure functions: records -> dict[str, float].

Names follow the project's scheme (`rollout/...`, `spec/...`; docs/tracking.md: What a run produces). Input: a `tlt.rollout.torch_engine.state.RolloutBatch`
(any object with the same fields works; nothing here runs a model) whose `stats` is a
`tlt.rollout.stats.RolloutStats`; the ratios are its derived properties.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tlt.rollout.stats import RolloutStats


def _percentile(values: list[int], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100 * (len(s) - 1)))))
    return float(s[k])


def length_metrics(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {}
    return {"rollout/response_length/mean": float(statistics.fmean(lengths)),
            "rollout/response_length/p50": _percentile(lengths, 50),
            "rollout/response_length/p90": _percentile(lengths, 90),
            "rollout/response_length/max": float(max(lengths))}


def spec_metrics(drafted: list[int], accepted: list[int], stats: RolloutStats) -> dict[str, float]:
    """Acceptance metrics of the speculative rounds (empty when SD never ran)."""
    out = {"spec/enabled_share": stats.enabled_share}
    if stats.guard_tripped is not None:  # batch-size tiers decoding without SD (tlt.rollout.guard)
        out["spec/guard_tripped"] = float(stats.guard_tripped)
    if stats.regret is not None:  # the bandit's cumulative regret, seconds (tlt.rollout.tuner)
        out.update({f"spec/regret/{bucket}": float(r) for bucket, r in stats.regret.items()})
        out["spec/regret"] = float(sum(stats.regret.values()))
    if stats.accept_len is None:
        return out
    out["spec/accept_len/mean"] = stats.accept_len
    out["spec/accept_rate"] = sum(accepted) / max(1, sum(drafted))
    # Rounds drafted by the model-free n-gram lookup (the group's own rollouts), where the tuner chose it.
    out["spec/ngram_share"] = stats.ngram_share
    if stats.ngram_accept_len is not None:
        out["spec/ngram_accept_len"] = stats.ngram_accept_len
    for i, rate in stats.accept_rate_by_pos.items():
        out[f"spec/accept_rate/pos_{i}"] = rate
    for bucket, arm in stats.top_strategy.items():
        # The arm played most often in this bucket (its index in the tuner's arm list).
        out[f"spec/strategy/{bucket}"] = float(arm)
    return out


def rollout_metrics(batch) -> dict[str, float]:
    """All rollout metrics of one `generate` call.

    spec/accept_len/mean: the live accept length, tokens per target pass of this rollout's own SD
    rounds (whatever strategies the tuner picked; the reported held-out accept length, eval/accept_len,
    is tlt.rollout.acceptance.heldout_accept's fixed-strategy figure); spec/accept_rate: accepted / drafted
    tokens (for trees, drafted counts every verified node); spec/accept_rate/pos_i: share of
    rounds drafting depth i+1 whose draft was accepted down to it; spec/enabled_share: share of
    tokens emitted by SD rounds; spec/ngram_share: share of the SD tokens from n-gram rounds,
    spec/ngram_accept_len their tokens per pass; spec/regret/{bucket} (and the sum, spec/regret): the
    seconds the bandit's choices cost so far against the best arm in hindsight; rollout/tail_share: share of time with <= spec_threshold rows.
    """
    stats: RolloutStats = batch.stats
    lengths = [len(r) for r in batch.response_ids]
    time_s = float(stats.time_s)
    out = {"rollout/time_s": time_s,
           "rollout/tokens_per_s": sum(lengths) / time_s if time_s > 0 else 0.0,
           "rollout/tail_share": stats.tail_share}
    if stats.target_forwards:  # batched target forwards (prefill, decode steps, verifies) of the rollout
        out["rollout/target_forwards"] = float(stats.target_forwards)
        out["rollout/tokens_per_target_forward"] = sum(lengths) / stats.target_forwards
    if stats.worker_idle_s is not None:  # sharded rollout (tlt.rollout.workers): worker-seconds spent waiting
        out["rollout/worker_idle_s"] = float(stats.worker_idle_s)
    out.update(length_metrics(lengths))
    out.update(spec_metrics(batch.drafted, batch.accepted, stats))
    return out
