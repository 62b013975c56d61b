"""Calibrate before exploring (tlt/rollout/breakeven.py): break-even accept lengths and predicted rewards by
hand, a tier where SD cannot pay never explored beyond epsilon, the curve measured on a tiny torch engine."""
import random

import pytest

from tlt.config import RolloutConfig, SpecStrategy
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine
from tlt.rollout.breakeven import CostCurve, calibrate, expected_accept, measure, seed
from tlt.rollout.tuner import PLAIN, StrategyTuner

C1, C2 = SpecStrategy(depth=1, topk=1, tokens=1), SpecStrategy(depth=2, topk=1, tokens=2)
# Tier 0 (batch 1): a round of depth 1 costs 1.25 plain steps, depth 2 1.5: SD pays from accept length 1.25.
# Tier 1 (batch 5): depth 1 costs 3.5 plain steps (> 2 tokens at most), depth 2 5.0 (> 3): SD cannot pay.
CURVE = CostCurve([1, 5], [[0.04, 0.05, 0.06], [0.1, 0.35, 0.5]])


def test_break_even_and_predicted_rewards_by_hand():
    assert expected_accept(0, 0.5) == 1.0 and expected_accept(2, 0.5) == pytest.approx(1.75)
    assert CURVE.break_even(0, 1) == pytest.approx(1.25) and CURVE.break_even(1, 2) == pytest.approx(5.0)
    assert CURVE.can_pay(0) and not CURVE.can_pay(1)
    assert CURVE.predicted_reward(0, PLAIN) == pytest.approx(25.0)  # 1 row / 0.04 s
    assert CURVE.predicted_reward(0, C1, rate=0.6) == pytest.approx(1.6 / 0.05)
    assert CURVE.predicted_reward(1, C2, rate=0.6) == pytest.approx(5 * 1.96 / 0.5)
    deeper = SpecStrategy(depth=4, topk=1, tokens=4)  # deeper than measured: priced at the deepest measured
    assert CURVE.break_even(0, 4) == CURVE.break_even(0, 2)
    s = CURVE.summary()
    assert s["can_pay"] == [True, False] and s["break_even"][1] == [None, pytest.approx(3.5), pytest.approx(5.0)]
    assert CURVE.predicted_reward(0, deeper) == pytest.approx(CURVE.predicted_reward(0, C2))
    ngram = CostCurve([1, 5], CURVE.round_s, ngram_s=[[None, None, None, 0.045], [None] * 4])
    n3 = SpecStrategy(depth=3, topk=1, tokens=3, source="ngram")
    assert ngram.break_even(0, 3, "ngram") == pytest.approx(0.045 / 0.04)  # no drafter forwards: cheaper rounds
    assert ngram.predicted_reward(0, n3, rate=0.5) == pytest.approx(1.875 / 0.045)
    assert ngram.break_even(1, 3, "ngram") == CURVE.break_even(1, 3)  # none measured there: a drafter chain's price


def _true_reward(tier: int, arm: SpecStrategy, rng: random.Random) -> float:
    """This machine's throughput with every draft accepted (the best SD can do), with noise."""
    return CURVE.predicted_reward(tier, arm, rate=1.0) * rng.uniform(0.9, 1.1)


@pytest.mark.parametrize("calibrated", [True, False])
def test_a_tier_that_cannot_pay_is_explored_at_most_epsilon(calibrated):
    eps, n = 0.1, 2000
    tuner = StrategyTuner([[PLAIN, C1, C2]] * 2, [1, 5], epsilon=eps, seed=0)
    if calibrated:
        seed(tuner, CURVE)
        assert tuner.choose(5) == PLAIN and tuner.choose(1) == C2  # start: off / the depth the curve favours
    rng, picks = random.Random(1), []
    for _ in range(n):
        arm = tuner.choose(5)
        picks.append(arm)
        tuner.update(5, arm, _true_reward(1, arm, rng), seconds=0.1)
    sd = sum(not a.plain for a in picks)
    if calibrated:  # exploration alone: epsilon x 2/3 of the rounds expected (~133); 4 sigma above stays < eps x n
        assert picks[0] == PLAIN and sd <= eps * n, sd
    else:  # untried arms first: both SD arms are played before the bandit learns
        assert not picks[1].plain and not picks[2].plain


def test_measure_and_calibrate_on_a_tiny_engine():
    model = tiny_model("llama", layers=2, hidden=64, vocab=64, seed=1)
    cfg = RolloutConfig(max_new_tokens=8, tuner=True, drafter="ngram", strategy=SpecStrategy(depth=2, topk=1, tokens=2))
    n4 = SpecStrategy(depth=4, topk=1, tokens=4, source="ngram")
    tuner = StrategyTuner([[PLAIN, C1, C2], [PLAIN, C2, n4]], [1, 3], epsilon=0.1)
    engine = RolloutEngine(model, cfg, eos_ids=[], pad_id=0, tuner=tuner)
    curve = measure(engine, tuner, vocab_size=64, new_tokens=4)
    assert curve.ngram_s[0] == [None] and curve.ngram_s[1][4] > 0 and curve.ngram_s[1][:4] == [None] * 4
    assert curve.buckets == [1, 3] and [len(r) for r in curve.round_s] == [3, 3]
    assert curve.round_s[1][1] is None and all(s > 0 for r in curve.round_s for s in r if s is not None)
    assert engine.tuner is tuner and all(len(r) == 0 for b in tuner.rewards for r in b)  # measuring is not playing
    summary = calibrate(engine, tuner, vocab_size=64)
    assert all(len(r) == 1 for b in tuner.rewards for r in b)  # one predicted reward per arm: nothing untried
    assert len(summary["can_pay"]) == 2 and summary["seconds"] > 0


def test_calibrated_only_when_asked():
    from tlt.rollout.breakeven import calibrated

    model = tiny_model("llama", layers=2, hidden=64, vocab=64, seed=1)
    cfg = RolloutConfig(max_new_tokens=8, tuner=True, drafter="ngram", tuner_calibrate=False)
    tuner = StrategyTuner([[PLAIN, C1]], [1], epsilon=0.1)
    engine = calibrated(RolloutEngine(model, cfg, eos_ids=[], pad_id=0, tuner=tuner), tuner, cfg, 64)
    assert engine.calibration is None and all(len(r) == 0 for r in tuner.rewards[0])
    on = cfg.model_copy(update={"tuner_calibrate": True})
    assert calibrated(engine, tuner, on, 64).calibration["can_pay"] is not None
    assert all(len(r) == 1 for r in tuner.rewards[0])
    assert calibrated(engine, None, on, 64).calibration is None  # no bandit, nothing to seed
