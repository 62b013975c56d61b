"""What the console says: one line per RL step and evaluation, the drafter's refresh summary (pure
functions of the logged metrics), and the run's headline numbers in MLflow."""
import math

import pytest

from tlt.config import DrafterConfig
from tlt.console import eval_line, refresh_summary, rows_by_step, step_line
from tlt.report import headline

PAYOFF = DrafterConfig(schedule="payoff")


def _m(decision: float, **kw) -> dict:
    return {"reward/mean": 0.25, "rollout/tokens_per_s": 86.0, "perf/tokens_per_s": 21.5, "spec/enabled_share": 0.42,
            "spec/accept_len/mean": 1.56, "timing_s/step": 12.3, "drafter/refresh_decision": decision, **kw}


def test_step_line_names_every_number_and_why_the_drafter_skipped():
    line = step_line(3, 8, _m(0.0, **{"drafter/payoff_s": -0.94, "drafter/spot_steps": 0.0}), None, PAYOFF)
    assert line == ("RL step 3/8: reward 0.250, rollout 86.0 tok/s (step 21.5 tok/s), SD share 42%, "
                    "live accept length 1.56, 12.3 s; drafter skipped (payoff -0.9 s ≤ 0)")


@pytest.mark.parametrize("drafter, metrics, prev, note", [
    (PAYOFF, {"drafter/spot_steps": 5.0}, None, "trained 5 drafter steps"),
    (PAYOFF, {"drafter/spot_steps": 1.0}, None, "trained 1 drafter step"),
    (PAYOFF, {"drafter/spot_steps": 0.0}, None, "due, trained 0 steps (empty buffer or no tail)"),
    (DrafterConfig(schedule="payoff", where="sequential"), {"drafter/steps": 24.0}, {"drafter/steps": 16.0},
     "trained 8 drafter steps"),
])
def test_trained_steps_spot_and_sequential(drafter, metrics, prev, note):
    assert step_line(1, 2, _m(1.0, **metrics), prev, drafter).endswith(f"; drafter {note}")


@pytest.mark.parametrize("drafter, metrics, prev, reason", [
    (DrafterConfig(schedule="frozen"), {}, None, "frozen (drafter.schedule: frozen)"),
    (DrafterConfig(schedule="every_k", refresh_every=3), {}, None, "not due (every 3 steps)"),
    (DrafterConfig(schedule="below_accept", refresh_below_accept_len=1.5), {}, {"spec/accept_len/mean": 1.8},
     "live accept length 1.80 ≥ 1.5"),
    (PAYOFF, {}, None, "no payoff estimate yet (needs a rollout with SD)"),
    (PAYOFF, {"drafter/payoff_s": 0.4}, None, "waiting to measure the last refresh"),
])
def test_skip_reasons(drafter, metrics, prev, reason):
    assert step_line(2, 2, _m(0.0, **metrics), prev, drafter).endswith(f"; drafter skipped ({reason})")


def test_no_drafter_no_note():
    assert "drafter" not in step_line(1, 1, _m(0.0), None, None)


def test_refresh_summary_counts_and_reasons():
    hist = {"drafter/refresh_decision": [(1, 1.0), (2, 0.0), (3, 0.0), (4, 1.0)],
            "drafter/spot_steps": [(1, 0.0), (2, 0.0), (3, 0.0), (4, 6.0)],
            "drafter/payoff_s": [(2, -0.9), (3, -0.2), (4, 0.3)]}
    line = refresh_summary(rows_by_step(hist), PAYOFF)
    assert line == ("drafter refreshes: 1 of 4 RL steps (schedule payoff, spot), at step 4 (6 drafter steps); "
                    "skipped: payoff ≤ 0 ×2, due, trained 0 steps (empty buffer or no tail) ×1")
    none = refresh_summary(rows_by_step({"drafter/refresh_decision": [(1, 0.0), (2, 0.0)]}),
                           DrafterConfig(schedule="frozen"))
    assert none == "drafter refreshes: 0 of 2 RL steps (schedule frozen); skipped: frozen (drafter.schedule: frozen) ×2"
    assert refresh_summary([], PAYOFF) == "" and refresh_summary(rows_by_step(hist), None) == ""


def test_eval_line_says_which_accept_length():
    assert eval_line(0, 0.25, 32) == "evaluation before training: held-out accuracy 0.250 (32 prompts)"
    assert eval_line(4, 0.5, 32, 2.38, 1.95) == ("evaluation after RL step 4: held-out accuracy 0.500 (32 prompts), "
                                                 "held-out accept length (fixed chain) greedy 2.38, sampled 1.95")


def test_headline_leaves_out_what_was_not_logged():
    numbers = {"accuracy": 0.5, "accept_len_heldout": 2.4, "accept_len_heldout_sampled": math.nan,
               "accept_len_live": 1.6, "rollout_tokens_per_s": 90.0, "step_tokens_per_s": 30.0, "step_time_s": 10.0,
               "refreshes": 2.0}
    metrics, text = headline(numbers)
    assert metrics == {"summary/heldout_accuracy": 0.5, "summary/heldout_accept_len_greedy": 2.4,
                       "summary/live_accept_len": 1.6, "summary/rollout_tokens_per_s": 90.0,
                       "summary/step_tokens_per_s": 30.0, "summary/step_time_s": 10.0, "summary/drafter_refreshes": 2.0}
    assert "| held-out accept length (fixed chain, greedy) | 2.40 |" in text and "sampled" not in text
