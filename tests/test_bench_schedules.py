"""bench/adaptive.py --schedules at tiny scale (conf/smoke.yaml, 2 RL steps): each schedule delivers what it
promises -- none trains nothing, the sequential budget is exact, the spot trainer is counted.
No timing assertions (shared machines)."""
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
bench = load_bench("adaptive")


@pytest.mark.slow
def test_schedules_smoke(tmp_path):
    res = bench.main([str(ROOT / "conf" / "smoke.yaml"), "--schedules", "none,spot,sequential", "--steps", "2",
                      "--drafter-steps", "3",
                      "--out-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "s.json")])
    arms, per = res["arms"], res["per_step"]
    assert set(arms) == {"none", "spot", "sequential"}
    assert all(r["drafter_steps"] == 0 and r["drafter_s"] == 0 for r in per["none"])
    assert [r["drafter_steps"] for r in per["sequential"]] == [3, 3]  # the buffer is filled before the refresh
    assert per["spot"][0]["drafter_steps"] == 0  # step 0: the tail comes before any rollout is buffered
    assert arms["none"]["rollout_slowdown_vs_none"] == pytest.approx(1.0)
    assert arms["none"]["drafter_share_of_step"] == 0.0  # no drafter time is booked to an arm that trains nothing
    assert 0.0 < arms["sequential"]["drafter_share_of_step"] < 1.0  # sequential drafter time sits inside the step
    for a in arms.values():
        assert a["drafter_share_of_step"] == pytest.approx(a["drafter_s"] / a["step_s"])


@pytest.mark.slow
def test_payoff_schedule_is_measured(tmp_path):
    """frozen, every_k and payoff with SD on: accept length per step, drafter totals and the ratios."""
    res = bench.main([str(ROOT / "conf" / "smoke.yaml"), "--schedules", "frozen,every_k,payoff", "--steps", "2",
                      "--drafter-steps", "2", "--set", "drafter.where=sequential", "--out-dir", str(tmp_path / "runs")])
    for arm in ("frozen", "every_k", "payoff"):
        assert len(res[f"accept_len_{arm}"]) == 3 and all(a >= 1.0 for a in res[f"accept_len_{arm}"]), arm
    assert res["drafter_steps_frozen"] == 0 and res["drafter_s_frozen"] == 0
    assert res["drafter_steps_every_k"] == 4 and res["drafter_s_every_k"] > 0  # 2 refreshes of 2 steps
    assert res["drafter_steps_payoff"] <= res["drafter_steps_every_k"]  # payoff trains at most every step
    assert res["accept_len_frozen"][0] == res["accept_len_every_k"][0] == res["accept_len_payoff"][0]  # same warm-start
    assert res["payoff_drafter_time_ratio"] == pytest.approx(res["drafter_s_payoff"] / res["drafter_s_every_k"])
    assert res["payoff_accept_ratio"] == pytest.approx(
        sum(res["accept_len_payoff"][1:]) / sum(res["accept_len_every_k"][1:]))  # means over the same steps
