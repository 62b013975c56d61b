"""What every engine's `generate` returns: one rollout's sequences, per-sequence counters and the
engine's stats (the contract's result type, shared by the torch engine, the pools and vLLM)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tlt.rollout.stats import RolloutStats


@dataclass
class RolloutBatch:
    """Sequences of one `generate` call, group-major (sequence i belongs to prompt group_index[i]).

    logprobs: policy log-probs of the sampled tokens at temperature 1 over the raw logits.
    drafted / accepted: draft tokens verified / accepted for the sequence; target_passes: target
    forwards that produced its tokens (prefill included). stats: engine-level counters
    (`RolloutStats`) read by `tlt.metrics.rollout_metrics`.
    """
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    group_index: list[int]
    finished_eos: list[bool]
    drafted: list[int]
    accepted: list[int]
    target_passes: list[int]
    stats: RolloutStats = field(default_factory=RolloutStats)
    features: list | None = None  # generate(capture=...): per sequence (aux [T,A], final hidden [T,H])
