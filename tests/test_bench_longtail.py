"""bench/longtail.py: its statistics as pure functions, and one tiny run on conf/smoke.yaml checked
for keys and value ranges (invariants only, never timings: the machines are shared)."""
import json
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
bench = load_bench("longtail")


def test_length_stats_hand_computed():
    out = bench.length_stats([10, 20, 30, 100], cap=100, finished_eos=[True, True, True, False])
    assert out["response_length/p50"] == 25.0 and out["response_length/max"] == 100.0
    assert out["at_cap_share"] == 0.25 and out["max_over_p50"] == 4.0
    assert bench.length_stats([100], cap=100, finished_eos=[True])["at_cap_share"] == 0.0  # EOS on the last slot


def test_reward_stats_counts_groups_with_variance():
    out = bench.reward_stats([1, 0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert out["groups"] == 3 and out["groups_with_variance"] == pytest.approx(2 / 3)
    assert out["accuracy"] == pytest.approx(3 / 9)


def test_bench_longtail_smoke(tmp_path):
    out_json = tmp_path / "lt.json"
    res = bench.main([str(ROOT / "conf" / "smoke.yaml"), "--prompts", "3", "--group", "2", "--json", str(out_json),
                      "--set", "rollout.max_new_tokens=12", "--update-reps", "1"])
    saved = json.loads(out_json.read_text())
    for key in ("response_length/p50", "response_length/p90", "response_length/max", "response_length/mean",
                "at_cap_share", "max_over_p50", "accuracy", "groups_with_variance", "groups", "lengths", "samples"):
        assert key in saved, key
    assert saved["groups"] == 3 and len(saved["lengths"]) == len(saved["samples"]) == 6
    assert 1 <= saved["response_length/p50"] <= saved["response_length/p90"] <= saved["response_length/max"] <= 12
    assert saved["max_over_p50"] >= 1.0
    for key in ("at_cap_share", "accuracy", "groups_with_variance"):
        assert 0.0 <= saved[key] <= 1.0, key
    assert res["max_new_tokens"] == 12 and res["config"] == "smoke"
    # --update-reps: the same update in rollout and in length order, on these 6 rollouts
    assert res["rows"] == 6 and res["response_lengths"] == sorted(saved["lengths"])
    assert set(res["update_s"]) == set(res["padding_share"]) == {"rollout_order", "length_order"}
    assert res["padding_share"]["length_order"] <= res["padding_share"]["rollout_order"] + 1e-9
    assert res["speedup"] == pytest.approx(min(res["update_s"]["rollout_order"]) / min(res["update_s"]["length_order"]))
