"""Bucketed epsilon-greedy strategy tuner: buckets, convergence on a synthetic table, state."""
import json
import random

import pytest

from tlt.config import SpecStrategy
from tlt.rollout import StrategyTuner, default_arms


def test_buckets_and_default_arms():
    tuner = StrategyTuner(buckets=[1, 2, 5, 21])
    assert [tuner.bucket_of(b) for b in (1, 2, 4, 5, 20, 21, 64)] == [0, 1, 1, 2, 2, 3, 3]
    arms = default_arms([1, 2, 5, 21])
    biggest = [max(a.tokens for a in bucket) for bucket in arms]
    assert biggest == sorted(biggest, reverse=True)  # longer drafts for smaller batches
    assert all(a.topk == 1 for bucket in arms for a in bucket)  # CPU cost curve: chains only
    assert {a.depth for a in arms[0]} >= {2, 3, 4} and max(a.depth for a in arms[-1]) <= 2
    assert all(a.tokens >= a.depth or a.topk == 1 for bucket in arms for a in bucket)


def test_converges_to_best_arm_per_bucket():
    """Noisy rewards from a table whose best arm differs per bucket; the median picks it."""
    tuner = StrategyTuner(buckets=[1, 2, 5, 21], epsilon=0.1, seed=0, window=50)
    means = [[1.0, 3.0, 2.0, 0.5], [2.0, 1.0, 4.0], [5.0, 1.0], [1.0, 3.0]]
    rng = random.Random(1)
    picks = {b: [] for b in range(4)}
    for step in range(2000):
        bs = rng.choice([1, 3, 8, 30])
        arm = tuner.choose(bs)
        b = tuner.bucket_of(bs)
        i = tuner.arm_index(bs, arm)
        noise = rng.expovariate(1.0) * 2 if rng.random() < 0.1 else rng.gauss(0, 0.3)  # heavy outliers
        tuner.update(bs, arm, means[b][i] + noise)
        if step > 1500:
            picks[b].append(i)
    for b, row in enumerate(means):
        best = max(range(len(row)), key=row.__getitem__)
        assert tuner.arm_index(tuner.buckets[b], tuner.best(tuner.buckets[b])) == best
        assert picks[b].count(best) / len(picks[b]) > 0.8  # exploitation ~ 1 - epsilon


def test_state_roundtrip_is_json_and_deterministic():
    a = StrategyTuner(epsilon=0.5, seed=3)
    for i in range(40):
        a.update(1 + i % 30, a.choose(1 + i % 30), float(i % 7))
    state = json.loads(json.dumps(a.state()))
    b = StrategyTuner(arms=[[SpecStrategy()]] * 4, buckets=[1, 2, 5, 21], seed=99)
    b.load_state(state)
    assert [a.choose(bs) for bs in range(1, 40)] == [b.choose(bs) for bs in range(1, 40)]
    assert b.state()["rewards"] == a.state()["rewards"]


def test_regret_by_hand():
    """Bucket 0: arm A played 2 s at 10 tok/s (20 tokens), arm B 1 s at 30 tok/s (30 tokens). Best in
    hindsight: B (30 tok/s); the same 50 tokens at 30 tok/s take 5/3 s, the bandit took 3 s: regret 4/3 s.
    Bucket 1: one arm only, regret 0; untimed updates (no seconds) count for nothing."""
    a, b = SpecStrategy(depth=1, topk=1, tokens=1), SpecStrategy(depth=2, topk=1, tokens=2)
    tuner = StrategyTuner(arms=[[a, b], [a, b]], buckets=[1, 4])
    tuner.update(1, a, 10.0, seconds=1.5)
    tuner.update(2, a, 10.0, seconds=0.5)
    tuner.update(3, b, 30.0, seconds=1.0)
    tuner.update(5, a, 7.0, seconds=2.0)
    tuner.update(5, b, 99.0)  # no seconds: a reward only
    assert tuner.regret() == [pytest.approx(3.0 - 50.0 / 30.0), 0.0]
    assert tuner.regret_stats() == {"0": pytest.approx(4 / 3), "1": 0.0}
    restored = StrategyTuner(arms=[[a, b], [a, b]], buckets=[1, 4])
    restored.load_state(json.loads(json.dumps(tuner.state())))
    assert restored.regret() == tuner.regret()


def test_regret_reaches_the_metrics_and_adds_over_shards():
    from tlt.metrics import spec_metrics
    from tlt.rollout.stats import RolloutStats

    x = RolloutStats(regret={"0": 1.0, "1": 0.25})
    y = RolloutStats(regret={"0": 0.5})
    m = spec_metrics([], [], x.merge(y))
    assert m["spec/regret/0"] == 1.5 and m["spec/regret/1"] == 0.25 and m["spec/regret"] == 1.75
    assert "spec/regret" not in spec_metrics([], [], RolloutStats())  # no bandit, no regret
