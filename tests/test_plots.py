"""tlt.plots: every figure has its bars / lines, says "no data" on empty input, and saves as PNG."""
import math

import pytest
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from tlt import plots


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def _saves(fig: Figure, tmp_path) -> None:
    path = tmp_path / "fig.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _labelled(ax) -> None:
    assert ax.get_title() and ax.get_xlabel()


def test_acceptance_by_position_one_bar_per_position(tmp_path):
    fig = plots.acceptance_by_position([8, 6, 3, 0], [10, 8, 6, 0])
    ax = fig.axes[0]
    assert len(ax.patches) == 4
    heights = [p.get_height() for p in ax.patches]
    assert heights[:3] == pytest.approx([0.8, 0.75, 0.5]) and heights[3] == 0  # never drafted: n/a
    assert "n/a" in [t.get_text() for t in ax.texts]
    _labelled(ax)
    assert "fraction" in ax.get_ylabel()
    _saves(fig, tmp_path)


def test_acceptance_by_position_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="draft position"):
        plots.acceptance_by_position([1, 2], [3])


def test_response_length_hist_marks_tail_and_limit(tmp_path):
    lengths = [10] * 200 + [20] * 30 + [64, 64]
    fig = plots.response_length_hist(lengths, max_new_tokens=64)
    ax = fig.axes[0]
    assert len(ax.lines) == 4  # p50, p90, max, limit
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "p50 = 10" and legend[2] == "max = 64" and "2 truncated" in legend[3]
    assert ax.get_yscale() == "log"  # 200 vs 2 per bin: the tail would vanish on a linear axis
    assert sum(p.get_height() for p in ax.patches) == len(lengths)
    assert "tokens" in ax.get_xlabel()
    _saves(fig, tmp_path)


def test_response_length_hist_without_limit_is_linear():
    ax = plots.response_length_hist([5, 6, 7, 8], None).axes[0]
    assert len(ax.lines) == 3 and ax.get_yscale() == "linear"


def test_time_breakdown_stacks_stages_in_order_with_other(tmp_path):
    timings = {"timing_s/update_policy": 2.0, "timing_s/rollout": 5.0, "timing_s/reward": 0.5,
               "timing_s/update_drafter": 0.0, "timing_s/step": 10.0}
    fig = plots.time_breakdown(timings)
    ax = fig.axes[0]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [s.split(":")[0] for s in labels] == ["rollout", "reward", "update_policy", "other"]
    assert len(ax.patches) == 4
    assert sum(p.get_width() for p in ax.patches) == pytest.approx(10.0)
    assert "50%" in labels[0] and ax.get_xlabel() == "time (s)"
    _saves(fig, tmp_path)


def test_time_breakdown_accepts_bare_stage_names():
    assert len(plots.time_breakdown({"rollout": 1.0, "sync": 0.2}).axes[0].patches) == 2


def test_curves_one_line_per_metric(tmp_path):
    hist = {"reward/mean": [(1, 0.3), (0, 0.1), (2, 0.5)], "eval/accuracy": [(0, 0.2), (2, 0.4)], "x": []}
    fig = plots.curves(hist, "Reward and accuracy")
    ax = fig.axes[0]
    assert len(ax.lines) == 2
    assert list(ax.lines[0].get_xdata()) == [0, 1, 2]  # sorted by step
    assert ax.get_title() == "Reward and accuracy" and ax.get_xlabel() == "RL step"
    assert plots.curves({"spec/accept_len/mean": [(0, 2.0)]}, "t").axes[0].get_ylabel() == \
        "spec/accept_len/mean (tokens)"
    _saves(fig, tmp_path)


@pytest.mark.parametrize("make", [
    lambda: plots.acceptance_by_position([], []),
    lambda: plots.response_length_hist([], 64),
    lambda: plots.time_breakdown({}),
    lambda: plots.time_breakdown({"timing_s/rollout": math.nan}),
    lambda: plots.curves({}, "empty"),
    lambda: plots.curves({"reward/mean": []}, "empty"),
])
def test_empty_input_says_no_data(make, tmp_path):
    fig = make()
    assert isinstance(fig, Figure) and plots.NO_DATA in _texts(fig)
    assert not any(isinstance(c, BarContainer) for ax in fig.axes for c in ax.containers)
    assert fig.axes[0].get_title()
    _saves(fig, tmp_path)


def test_figures_close_safely():
    import matplotlib.pyplot as plt

    fig = plots.curves({"reward/mean": [(0, 1.0)]}, "t")
    plt.close(fig)  # not registered with pyplot: a no-op, and nothing leaks into plt's registry
    assert plt.get_fignums() == []


def test_metric_units():
    assert plots.metric_unit("timing_s/rollout") == "s"
    assert plots.metric_unit("rollout/tokens_per_s") == "tokens/s"
    assert plots.metric_unit("eval/accuracy") == "fraction"
    assert plots.metric_unit("reward/mean") == ""


def test_draw_curves_keeps_colours_when_a_series_is_empty():
    fig, axes = plots.new_figure()
    assert plots.draw_curves(axes[0, 0], {"a": [], "b": [(0, 1.0)]}, "t", "y") == 1
    assert axes[0, 0].lines[0].get_color() == "C1"


def test_accept_vs_drift_one_line_per_arm(tmp_path):
    arms = {"frozen": [2.5, 2.0, 1.8], "adaptive": [2.5, 2.4, 2.3], "control": [2.5, 2.1, 1.9]}
    fig = plots.accept_vs_drift([0.0, 0.2, 0.4], arms, kl=[0.0, 0.1, 0.3])
    left, right = fig.axes[0], fig.axes[1]
    assert [line.get_label() for line in left.lines] == list(arms)
    assert list(left.lines[1].get_xdata()) == [0.0, 0.2, 0.4] and list(left.lines[1].get_ydata()) == arms["adaptive"]
    assert len(right.lines) == 3 and len(fig.axes) == 3  # the KL twin axis
    _labelled(left)
    _saves(fig, tmp_path)
    assert plots.NO_DATA in _texts(plots.accept_vs_drift([], {}))
