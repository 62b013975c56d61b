"""bench/adaptive.py at tiny scale (conf/smoke.yaml, 2 RL steps): JSON keys and the invariants of
its numbers, its drift / bootstrap helpers on hand-made inputs. No timing assertions."""
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from bench_scripts import load_bench

from tlt.drafter.accept_eval import accept_ratio_ci

ROOT = Path(__file__).resolve().parents[1]
bench = load_bench("adaptive")


def test_token_drift_by_hand():
    start = [[1, 2, 3, 4], [5, 6]]
    assert bench.token_drift(start, start) == 0.0
    # prompt 0: last token differs (1 of 4); prompt 1: one token more (1 of 3) -> 2 / 7
    assert bench.token_drift([[1, 2, 3, 9], [5, 6, 7]], start) == pytest.approx(2 / 7)


def test_accept_ratio_ci_brackets_the_ratio():
    rng = np.random.default_rng(1)
    passes = rng.integers(5, 15, size=40)
    a = SimpleNamespace(tokens=passes * 3, passes=passes)
    b = SimpleNamespace(tokens=passes * 2, passes=passes)
    lo, hi = accept_ratio_ci(a, b)
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)  # every prompt gains exactly 1.5x
    noisy = SimpleNamespace(tokens=passes * 2 + rng.integers(0, 3, size=40), passes=passes)
    lo, hi = accept_ratio_ci(a, noisy)
    ratio = a.tokens.sum() / a.passes.sum() / (noisy.tokens.sum() / noisy.passes.sum())
    assert lo < ratio < hi


@pytest.mark.slow
def test_bench_adaptive_tiny_run(tmp_path, mlflow_uri):
    out_json = tmp_path / "adaptive.json"
    steps = 2
    res = bench.main([str(ROOT / "conf" / "smoke.yaml"), "--steps", str(steps), "--drafter-steps", "2",
                      "--eval-prompts", "6", "--eval-tokens", "8", "--kl-prompts", "3", "--sd-prompts", "1",
                      "--oracle-steps", "2", "--oracle-prompts", "3",
                      "--mlflow-uri", mlflow_uri, "--json", str(out_json), "--out-dir", str(tmp_path / "runs")])
    saved = json.loads(out_json.read_text())
    for key in ("drift_token_share", "kl", "accept_frozen", "accept_adaptive", "accept_control", "gain_vs_frozen",
                "gain_vs_control", "gain_vs_frozen_ci", "drafter_steps_per_rl_step", "drafter_s_per_rl_step"):
        assert key in saved, key
    for key in ("drift_token_share", "kl", "accept_frozen", "accept_adaptive", "accept_control"):
        assert len(saved[key]) == steps + 1, key  # one entry per policy snapshot: start + after each step
    assert saved["drift_token_share"][0] == 0.0 and saved["kl"][0] == 0.0
    assert all(0.0 <= d <= 1.0 for d in saved["drift_token_share"]) and all(k >= -1e-4 for k in saved["kl"][1:])
    for arm in bench.ARMS:
        assert all(1.0 <= a <= bench.DEPTH + 1 for a in saved[f"accept_{arm}"]), arm
        assert all(0.0 <= f <= 1.0 for f in saved[f"first_accept_{arm}"]), arm
    # every arm starts from the same warm-started drafter: identical at the start policy
    assert saved["accept_frozen"][0] == saved["accept_adaptive"][0] == saved["accept_control"][0]
    assert saved["frozen_recheck_equal"]  # the frozen arm's accept is recomputed identically
    # the oracle trains a copy on the final policy's own rollouts; the adaptive drafter is untouched
    assert saved["adaptive_recheck_equal"]
    assert saved["oracle_steps"] == 2 and saved["oracle_prompts"] == 3 and saved["oracle_buffer_tokens"] > 0
    assert 1.0 <= saved["accept_oracle"] <= bench.DEPTH + 1
    assert saved["oracle_gain_vs_frozen"] == pytest.approx(saved["accept_oracle"] / saved["accept_frozen"][-1])
    assert saved["drafter_steps_per_rl_step"] == 2.0 and saved["drafter_s_per_rl_step"] > 0
    lo, hi = saved["gain_vs_frozen_ci"]
    assert 0 < lo <= hi
    assert set(res["sd_check"]) == {"frozen", "adaptive"}
    assert all(row["greedy_identical"] for row in res["sd_check"].values())  # greedy SD is lossless

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    paths = [f.path for f in client.list_artifacts(res["mlflow_run_id"], "adaptive")]
    assert "adaptive/accept_vs_drift.png" in paths
    hist = client.get_metric_history(res["mlflow_run_id"], "adaptive/accept_len/adaptive")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == list(range(steps + 1))
