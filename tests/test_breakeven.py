"""Calibrate before exploring (tlt/rollout/breakeven.py): break-even accept lengths and predicted rewards by
hand, a tier where SD cannot pay never explored beyond epsilon, the curve measured on a tiny torch engine."""
import random

import pytest

from tlt.config import RolloutConfig, SpecStrategy
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine
from tlt.rollout.breakeven import (DEFAULT_THRESHOLD, NO_BOUND, CostCurve, calibrate, expected_accept, measure,
                                   rate_of, reprice, seed, tail_threshold)
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
    assert all(v is not None for b in range(2) for v in tuner.values(b))  # one predicted reward per arm: nothing untried
    assert all(len(r) == 0 for b in tuner.rewards for r in b)  # a prior, not a played reward
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
    assert tuner.prior is not None and all(v is not None for v in tuner.values(0))
    assert calibrated(engine, None, on, 64).calibration is None  # no bandit, nothing to seed


def test_rate_of_inverts_expected_accept():
    for depth in (1, 2, 4):
        for rate in (0.0, 0.3, 0.6, 0.95):
            assert rate_of(expected_accept(depth, rate), depth) == pytest.approx(rate, abs=1e-9)
    assert rate_of(0.5, 3) == pytest.approx(0.0) and rate_of(9.0, 3) == pytest.approx(1.0)  # clamped
    with pytest.raises(ValueError, match="depth"):
        rate_of(1.5, 0)


# Three tiers: at batch 1 a depth-2 round costs 1.5 plain steps, at batch 2 2.2, at batch 5 2.8 (break-even
# accept lengths). At rate 0.6 a depth-2 chain emits 1.96 tokens: it pays at batch 1 only; at 0.9 (2.71) at
# batches 1 and 2; at 1.0 (3 tokens, 7 % over 2.8) everywhere; at 0.2 (1.24) nowhere.
TIERS = CostCurve([1, 2, 5], [[0.04, None, 0.06], [0.05, None, 0.11], [0.1, None, 0.28]])


@pytest.mark.parametrize("rate, threshold", [(0.2, 0), (0.6, 1), (0.9, 4), (1.0, NO_BOUND)])
def test_tail_threshold_is_the_widest_paying_run_of_tiers(rate, threshold):
    arms = [[PLAIN, C2]] * 3
    assert TIERS.tail_threshold(arms, rate) == threshold
    tuner = StrategyTuner([[PLAIN, C2] for _ in range(3)], [1, 2, 5], epsilon=0.1)
    cal = reprice(tuner, TIERS.summary(), rate)
    assert cal["tail_threshold"] == threshold and cal["prior_accept_rate"] == rate
    assert tail_threshold("auto", cal) == threshold and tail_threshold(3, cal) == 3  # a number wins
    assert tail_threshold("auto", cal, cap=2) == min(threshold, 2) and tail_threshold(9, cal, cap=2) == 9
    # the bandit starts where the curve says: SD in the paying tiers, plain in the others
    assert [not tuner.choose(low).plain for low in (1, 2, 5)] == cal["pays"]


def test_reprice_replaces_the_prior_and_keeps_played_rewards():
    tuner = StrategyTuner([[PLAIN, C2] for _ in range(3)], [1, 2, 5], epsilon=0.0)
    reprice(tuner, TIERS.summary(), 0.9)
    assert tuner.choose(2) == C2
    tuner.update(2, PLAIN, 30.0, seconds=1.0)  # played: plain measured well below the SD prior
    reprice(tuner, TIERS.summary(), 0.2)  # the drafter measured poorly: SD's prior drops under plain's
    assert tuner.choose(2) == PLAIN and list(tuner.rewards[1][0]) == [30.0]
    state = tuner.state()
    again = StrategyTuner([[PLAIN, C2] for _ in range(3)], [1, 2, 5], epsilon=0.0)
    again.load_state(state)
    assert again.prior == tuner.prior and again.values(1) == tuner.values(1)  # the prior is checkpointed


def test_auto_threshold_without_a_curve_is_the_default():
    assert tail_threshold("auto", None) == DEFAULT_THRESHOLD


def test_an_engine_decodes_with_its_calibrated_threshold():
    """`spec_threshold: auto` on a torch engine: SD starts when the re-priced threshold says, a number overrides."""
    from tlt.rollout.breakeven import calibrated

    model = tiny_model("llama", layers=2, hidden=64, vocab=64, seed=1)
    cfg = RolloutConfig(max_new_tokens=6, temperature=0.0, tuner=True, drafter="ngram", tuner_plain_arm=True)
    assert RolloutEngine(model, cfg, eos_ids=[], pad_id=0, tuner=StrategyTuner.from_config(cfg)).threshold() \
        == DEFAULT_THRESHOLD  # not calibrated
    tuner = StrategyTuner.from_config(cfg)
    engine = calibrated(RolloutEngine(model, cfg, eos_ids=[], pad_id=0, tuner=tuner), tuner, cfg, 64)
    assert engine.calibration["seconds"] > 0  # measured on this engine; priced below on a known curve (timings are noisy)
    engine.calibration = CostCurve(tuner.buckets, [[0.01 * (1 + 0.25 * d) for d in range(len(row))]
                                                   for row in engine.calibration["round_s"]]).summary()
    engine.set_accept_prior(0.0)  # nothing is ever accepted: SD cannot pay in any tier
    assert engine.calibration["tail_threshold"] == 0 and engine.threshold() == 0 and engine.threshold(5) == 5
    prompts = [[5, 6, 7, 8]] * 3
    out = engine.generate(prompts)
    assert out.stats.spec_steps == 0 and out.stats.tail_time_s == 0  # never in the tail: SD never ran
    engine.set_accept_prior(1.0)  # every draft accepted: a round of depth d (1 + d / 4 steps) pays everywhere
    # the torch engine caps `auto` at DEFAULT_THRESHOLD: the curve only lowers its threshold
    assert engine.calibration["tail_threshold"] == NO_BOUND and engine.threshold() == DEFAULT_THRESHOLD
    assert engine.calibration["prior_accept_rate"] == 1.0
    assert engine.generate(prompts[:1]).stats.spec_steps > 0


def test_the_run_says_where_it_will_speculate():
    from tlt.stages.warmstart import prior_line

    assert prior_line(None, 4) == "" and prior_line(0.5, None) == ""  # nothing priced: nothing said
    assert "SD off" in prior_line(0.2, 0) and "0.20 per draft" in prior_line(0.2, 0)
    assert "while <= 4 sequences decode" in prior_line(0.6, 4)
    assert "at every batch size" in prior_line(0.95, NO_BOUND)


def test_a_tier_pays_only_by_the_margin():
    """A predicted gain under PAY_MARGIN (the curve's own error) does not move the threshold past the tier."""
    from tlt.rollout.breakeven import PAY_MARGIN

    curve = CostCurve([1, 5], [[0.04, 0.05], [0.1, 0.15]])  # batch 5: depth 1 breaks even at 1.5
    arms = [[PLAIN, C1]] * 2
    # accept lengths 1 + rate of 2.5 % and 10 % over the break-even
    thin, clear = 1.5 * (1 + PAY_MARGIN / 2) - 1, 1.5 * (1 + 2 * PAY_MARGIN) - 1
    assert curve.pays(1, arms[1], clear) and not curve.pays(1, arms[1], thin)
    assert curve.tail_threshold(arms, thin) == 4 and curve.tail_threshold(arms, clear) == NO_BOUND
