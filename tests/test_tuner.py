"""Bucketed epsilon-greedy strategy tuner: buckets, convergence on a synthetic table, state."""
import json
import random

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
