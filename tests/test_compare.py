"""tlt.compare against a real sqlite MLflow store: numbers in the table, the plot grid, user errors."""
import math
import time
from pathlib import Path

import pytest

from tlt import compare
from tlt.errors import UserError
from tlt.tracking import MlflowTracker

SD_ON = [  # (step, metrics) of a run with speculative decoding and a spot-trained drafter
    (0, {"eval/accuracy": 0.25, "eval/accept_len": 2.2, "eval/accept_len_sampled": 1.9}),
    (1, {"reward/mean": 0.1, "spec/accept_len/mean": 2.0, "timing_s/step": 2.0,
         "timing_s/update_drafter": 0.5, "rollout/tokens_per_s": 100.0, "perf/tokens_per_s": 50.0,
         "drafter/refresh_decision": 1.0, "drafter/spot_steps": 3.0}),
    (2, {"reward/mean": 0.2, "spec/accept_len/mean": 2.5, "timing_s/step": 4.0,
         "timing_s/update_drafter": 1.0, "rollout/tokens_per_s": 200.0, "perf/tokens_per_s": 60.0,
         "drafter/refresh_decision": 0.0, "drafter/payoff_s": -0.9, "drafter/spot_steps": 0.0}),
    (3, {"reward/mean": 0.3, "eval/accuracy": 0.5, "eval/accept_len": 2.4, "eval/accept_len_sampled": 2.0,
         "spec/accept_len/mean": 3.0, "timing_s/step": 6.0, "timing_s/update_drafter": 1.5,
         "rollout/tokens_per_s": 300.0, "perf/tokens_per_s": 70.0, "drafter/refresh_decision": 1.0,
         "drafter/spot_steps": 2.0}),
    (3, {"reward/mean": 0.4}),  # re-logged after a resume: the latest value wins
]
SD_OFF = [  # no drafter, no evaluation of accept lengths, throughput only as perf/tokens_per_s
    (0, {"reward/mean": 0.0, "spec/accept_len/mean": 1.0, "timing_s/step": 3.0, "perf/tokens_per_s": 80.0}),
    (1, {"reward/mean": 0.1, "eval/accuracy": 0.3, "spec/accept_len/mean": 1.0, "timing_s/step": 5.0,
         "perf/tokens_per_s": 120.0}),
]


def _run(experiment: str, name: str, steps) -> str:
    tracker = MlflowTracker(experiment=experiment, run_name=name)
    for step, metrics in steps:
        tracker.log_metrics(metrics, step=step)
        time.sleep(0.002)  # distinct timestamps, so "latest per step" is well defined
    tracker.end()
    return tracker.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (creating it runs MLflow's migrations, ~1 s)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        on = _run("cmp", "sd-on", SD_ON)
        time.sleep(0.01)
        off = _run("cmp", "sd-off", SD_OFF)
        bare = _run("cmp-bare", "bare", [])
        yield {"uri": uri, "on": on, "off": off, "bare": bare}


def test_table_numbers(store):
    df = compare.compare_runs([store["on"], store["off"]]).set_index("name")
    on, off = df.loc["sd-on"], df.loc["sd-off"]
    assert on["run"] == store["on"][:8] and on["status"] == "FINISHED"
    assert on["accuracy"] == 0.5 and on["reward"] == 0.4
    assert (on["accept_len_heldout"], on["accept_len_heldout_sampled"]) == (2.4, 2.0)  # the last evaluation's
    assert on["accept_len_live"] == pytest.approx(2.5)  # the rollout's own, mean over the steps
    assert on["rollout_tokens_per_s"] == pytest.approx(200.0) and on["step_tokens_per_s"] == pytest.approx(60.0)
    assert on["step_time_s"] == pytest.approx(4.0)
    assert on["refreshes"] == 2  # steps 1 and 3 trained; step 2 was skipped
    assert on["drafter_share"] == pytest.approx(3.0 / 12.0)
    assert on["steps"] == 3
    assert off["step_tokens_per_s"] == pytest.approx(100.0) and math.isnan(off["rollout_tokens_per_s"])
    assert math.isnan(off["drafter_share"]) and math.isnan(off["refreshes"]) and math.isnan(off["accept_len_heldout"])
    assert off["accuracy"] == pytest.approx(0.3) and off["steps"] == 2


def test_missing_metrics_are_nan(store):
    row = compare.compare_runs([store["bare"]], uri=store["uri"]).iloc[0]
    metrics = [c for c in compare.COLUMNS if c not in ("run", "name", "status", "steps")]
    assert all(math.isnan(row[m]) for m in metrics) and row["steps"] == 0
    assert "-" in compare.format_table(compare.compare_runs([store["bare"]]))


def test_by_experiment_newest_first_and_short_ids(store):
    assert compare.experiment_run_ids("cmp") == [store["off"], store["on"]]
    df = compare.compare_runs([store["on"][:8], store["on"]])  # a prefix and the full id: one run
    assert list(df["run_id"]) == [store["on"]]


def test_format_table_names_what_each_number_measures(store):
    text = compare.format_table(compare.compare_runs([store["on"], store["off"]]))
    for expected in ("held-out accept len (greedy)", "held-out accept len (sampled)", "live accept len",
                     "rollout tok/s", "step tok/s", "drafter refreshes", "drafter share", "sd-on", "sd-off",
                     store["on"][:8], "25.0%", "2.40", "2.50", "200.0"):
        assert expected in text, expected
    assert "SD speedup" not in text  # no run logs a plain-decoding baseline to divide by


def test_plot_grid_shows_the_documented_panels(store, tmp_path):
    fig = compare.compare_plot([store["on"], store["off"]])
    assert [ax.get_title() for ax in fig.axes] == list(compare.PANELS)
    lines = {ax.get_title(): len(ax.lines) for ax in fig.axes}
    assert lines == {"reward": 2, "held-out accuracy": 2, "held-out accept length (fixed chain, greedy)": 1,
                     "live accept length (rollout)": 2, "rollout tokens/s": 1, "step tokens/s": 2,
                     "RL step time": 2, "drafter share of the step": 1}
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == [f"sd-on ({store['on'][:8]})", f"sd-off ({store['off'][:8]})"]
    assert list(fig.axes[1].lines[0].get_xdata()) == [0, 3]  # eval only where logged
    share = fig.axes[7].lines[0]
    assert list(share.get_ydata()) == pytest.approx([0.25, 0.25, 0.25])
    # docs/tracking.md describes this plot by the same panel names
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "tracking.md").read_text().split())
    assert all(title in page for title in compare.PANELS), [t for t in compare.PANELS if t not in page]


def test_command_by_experiment_writes_png(store, tmp_path):
    out = tmp_path / "sub" / "cmp.png"
    text = compare.compare_command([], experiment="cmp", out=out)
    assert "sd-on" in text and "sd-off" in text and str(out) in text
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_unknown_run_id_is_a_user_error(store):
    with pytest.raises(UserError, match="deadbeef.*--experiment"):
        compare.compare_runs([store["on"], "deadbeef"])


def test_unknown_or_empty_experiment_is_a_user_error(store):
    from mlflow.tracking import MlflowClient

    MlflowClient(store["uri"]).create_experiment("empty")
    with pytest.raises(UserError, match="'empty' has no runs.*cmp"):
        compare.compare_command([], experiment="empty")
    with pytest.raises(UserError, match="'nope' has no runs"):
        compare.experiment_run_ids("nope")
    with pytest.raises(UserError, match="run ids"):
        compare.compare_command([])


def test_warns_when_a_run_has_unsent_calls(store, tmp_path, monkeypatch):
    """A run whose end fell in an MLflow outage: its numbers are partial until `tlt tracking sync`."""
    from tlt.spool import Spool

    monkeypatch.setenv("TLT_MLFLOW_SPOOL_DIR", str(tmp_path / "spool"))
    assert "warning" not in compare.compare_command([store["on"], store["off"]])
    Spool(tmp_path / "spool", store["off"]).append("terminate", {"status": "FINISHED"})
    text = compare.compare_command([store["on"], store["off"]])
    warnings = [ln for ln in text.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and store["off"] in warnings[0] and "tlt tracking sync" in warnings[0]
    assert str(tmp_path / "spool" / f"{store['off']}.jsonl") in warnings[0]


def test_bandit_regret_is_the_last_cumulative_value():
    row = compare.summarize({"spec/regret": [(0, 0.5), (1, 1.25)], "timing_s/step": [(0, 2.0), (1, 2.0)]})
    assert row["regret_s"] == 1.25
    assert math.isnan(compare.summarize({})["regret_s"])
