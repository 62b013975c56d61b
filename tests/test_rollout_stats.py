"""RolloutStats: merge of shard counters, and metrics equal to the formulas of the old stats dict."""
from dataclasses import asdict

import pytest

from tlt.metrics import rollout_metrics
from tlt.rollout.batch import RolloutBatch
from tlt.rollout.stats import SUMMED, RolloutStats


def _stats(**kw) -> RolloutStats:
    base = dict(time_s=2.0, prefill_s=0.1, tail_time_s=0.5, decode_steps=7, spec_steps=3, tuner_plain_steps=1,
                spec_row_passes=6, spec_tokens=15, ngram_row_passes=2, ngram_tokens=4, target_forwards=11,
                tokens=30, accepted_pos=[5, 2, 0], drafted_pos=[6, 4, 2],
                strategy={"0": {"1": 2, "2": 2}, "3": {"0": 1}})
    return RolloutStats(**{**base, **kw})


def _batch(stats: RolloutStats) -> RolloutBatch:
    lengths = [10, 12, 8]
    return RolloutBatch([[1]] * 3, [[5] * n for n in lengths], [[0.0] * n for n in lengths], [0, 0, 1],
                        [True] * 3, [8, 6, 0], [5, 4, 0], [4, 5, 8], stats=stats)


def _old_formulas(batch) -> dict[str, float]:
    """The metrics as tlt.metrics computed them from the string-keyed stats dict (before RolloutStats)."""
    stats = {k: v for k, v in asdict(batch.stats).items() if v is not None}
    lengths = [len(r) for r in batch.response_ids]
    time_s = float(stats.get("time_s", 0.0))
    out = {"rollout/time_s": time_s, "rollout/tokens_per_s": sum(lengths) / time_s if time_s > 0 else 0.0,
           "rollout/tail_share": stats.get("tail_time_s", 0.0) / time_s if time_s > 0 else 0.0}
    if stats.get("target_forwards"):
        out["rollout/target_forwards"] = float(stats["target_forwards"])
        out["rollout/tokens_per_target_forward"] = sum(lengths) / stats["target_forwards"]
    if "worker_idle_s" in stats:
        out["rollout/worker_idle_s"] = float(stats["worker_idle_s"])
    passes, tokens = stats.get("spec_row_passes", 0), stats.get("tokens", 0)
    out["spec/enabled_share"] = stats.get("spec_tokens", 0) / tokens if tokens else 0.0
    if passes:
        out["spec/accept_len/mean"] = stats["spec_tokens"] / passes
        out["spec/accept_rate"] = sum(batch.accepted) / max(1, sum(batch.drafted))
        out["spec/ngram_share"] = stats.get("ngram_tokens", 0) / max(1, stats["spec_tokens"])
        if stats.get("ngram_row_passes", 0):
            out["spec/ngram_accept_len"] = stats["ngram_tokens"] / stats["ngram_row_passes"]
        for i, (a, d) in enumerate(zip(stats.get("accepted_pos", []), stats.get("drafted_pos", []))):
            if d:
                out[f"spec/accept_rate/pos_{i}"] = a / d
        for bucket, counts in stats.get("strategy", {}).items():
            out[f"spec/strategy/{bucket}"] = float(max(counts, key=lambda k: (counts[k], -int(k))))
    return out


@pytest.mark.parametrize("kw", [{}, {"worker_idle_s": 0.3}, {"spec_row_passes": 0, "spec_tokens": 0},
                                {"ngram_row_passes": 0, "ngram_tokens": 0}, {"time_s": 0.0, "target_forwards": 0},
                                {"tokens": 0, "drafted_pos": [6, 0, 2]}])
def test_metrics_match_the_formulas_of_the_stats_dict(kw):
    batch = _batch(_stats(**kw))
    m = rollout_metrics(batch)
    old = _old_formulas(batch)
    assert m.keys() - {k for k in m if k.startswith("rollout/response_length/")} == old.keys()
    for k, v in old.items():
        assert m[k] == pytest.approx(v), k


def test_metrics_hand_computed():
    m = rollout_metrics(_batch(_stats()))
    assert m["spec/accept_len/mean"] == 2.5 and m["spec/enabled_share"] == 0.5 and m["rollout/tail_share"] == 0.25
    assert m["spec/ngram_share"] == pytest.approx(4 / 15) and m["spec/ngram_accept_len"] == 2.0
    assert m["spec/accept_rate/pos_1"] == 0.5 and m["spec/strategy/0"] == 1.0 and m["spec/strategy/3"] == 0.0
    assert m["spec/accept_rate"] == pytest.approx(9 / 14) and "rollout/worker_idle_s" not in m


def test_merge_adds_counters_and_keeps_the_longest_times():
    a = _stats()
    b = _stats(time_s=3.0, tail_time_s=0.2, spec_tokens=5, accepted_pos=[1], drafted_pos=[2],
               strategy={"0": {"1": 1}, "5": {"2": 4}})
    m = a.merge(b)
    for k in SUMMED:
        assert getattr(m, k) == getattr(a, k) + getattr(b, k), k
    assert m.workers == 2 and m.spec_tokens == 20
    assert m.time_s == 3.0 and m.tail_time_s == 0.5
    assert m.accepted_pos == [6, 2, 0] and m.drafted_pos == [8, 4, 2]
    assert m.strategy == {"0": {"1": 3, "2": 2}, "3": {"0": 1}, "5": {"2": 4}}
    assert m.worker_idle_s is None and a.accepted_pos == [5, 2, 0]  # inputs untouched
    assert a.merge(_stats(worker_idle_s=0.4)).worker_idle_s == 0.4
    assert RolloutStats(workers=0).merge(a) == a


def test_vllm_reply_becomes_rollout_stats():
    """The vLLM backend's reply -> RolloutStats (no vLLM needed: `reply_batch` is pure)."""
    from tlt.rollout.vllm_engine.reply import reply_batch

    seqs = [{"ids": [4, 5, 6, 7], "logprobs": [0.0] * 4, "finish": "stop",
             "spec": {"drafts": 2, "draft_tokens": 6, "accepted": 1, "accepted_pos": [1]}},
            {"ids": [4, 5], "logprobs": [0.0] * 2, "finish": "length", "spec": None}]
    reply = {"seqs": seqs, "tail_time_s": 0.1, "steps": 5, "counters": {"drafts": 2}, "time_s": 0.4}
    out = reply_batch([[1], [2]], 1, reply, wall_s=0.5, depth=3)
    s = out.stats
    assert isinstance(s, RolloutStats) and s.spec_row_passes == 2 and s.spec_tokens == 3 and s.tokens == 6
    assert s.accepted_pos == [1, 0, 0] and s.drafted_pos == [2, 2, 2] and s.vllm == {"drafts": 2, "time_s": 0.4}
    assert rollout_metrics(out)["spec/accept_len/mean"] == 1.5
