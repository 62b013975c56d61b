"""Figures of a run: pure functions from numbers to matplotlib `Figure`s.

Figures are built with `matplotlib.figure.Figure` directly (Agg canvas), not pyplot: no global
figure registry, nothing to leak across Prefect task threads, nothing ever shown. Callers save
them (`fig.savefig`) or log them (`tracker.log_figure`); `plt.close(fig)` is harmless.
Empty input gives a figure that says "no data" instead of raising.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# Order of the stages of one RL step (`timing_s/*`); other keys follow in input order.
STAGES = ("rollout", "reward", "old_logprob", "update_policy", "update_drafter", "sync", "checkpoint")
NO_DATA = "no data"


def new_figure(width: float = 7.0, height: float = 4.0, nrows: int = 1, ncols: int = 1) -> tuple[Figure, np.ndarray]:
    """A pyplot-free figure on an Agg canvas and its axes grid (always a 2-D array)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, np.atleast_2d(fig.subplots(nrows, ncols, squeeze=False))


def mark_no_data(ax: Axes, title: str) -> None:
    """Turn `ax` into a titled placeholder that says there is nothing to plot."""
    ax.set_title(title)
    ax.text(0.5, 0.5, NO_DATA, ha="center", va="center", transform=ax.transAxes, fontsize=14, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def metric_unit(key: str) -> str:
    """The unit of a tlt metric name, for axis labels ("" when dimensionless or unknown)."""
    if "tokens_per_s" in key:
        return "tokens/s"
    if key.startswith("timing_s/") or key.endswith("_s"):
        return "s"
    if "accept_len" in key or "response_length" in key:
        return "tokens"
    if "speedup" in key:
        return "×"
    if "accuracy" in key or "accept_rate" in key or "share" in key or "pass_at" in key:
        return "fraction"
    return ""


def axis_label(key: str) -> str:
    unit = metric_unit(key)
    return f"{key} ({unit})" if unit else key


def _no_data_figure(title: str) -> Figure:
    fig, axes = new_figure()
    mark_no_data(axes[0, 0], title)
    return fig


def acceptance_by_position(accepted_per_pos: list[float], drafted_per_pos: list[float]) -> Figure:
    """Bar chart of the acceptance rate accepted[i] / drafted[i] at draft position i (1-based).

    Positions never drafted get no bar (NaN), so a deep strategy that was never tried is visible
    as a gap rather than as a rate of zero.
    """
    title = "Draft acceptance rate by position"
    if len(accepted_per_pos) != len(drafted_per_pos):
        raise ValueError(f"accepted ({len(accepted_per_pos)}) and drafted ({len(drafted_per_pos)}) "
                         "must have one entry per draft position")
    if not accepted_per_pos:
        return _no_data_figure(title)
    accepted, drafted = np.asarray(accepted_per_pos, float), np.asarray(drafted_per_pos, float)
    rate = np.divide(accepted, drafted, out=np.full_like(accepted, np.nan), where=drafted > 0)
    positions = np.arange(1, len(rate) + 1)
    fig, axes = new_figure()
    ax = axes[0, 0]
    bars = ax.bar(positions, np.nan_to_num(rate), color="tab:blue")
    ax.bar_label(bars, labels=["n/a" if math.isnan(r) else f"{r:.2f}" for r in rate], fontsize=8)
    ax.set(title=title, xlabel="draft position (token index in the draft)",
           ylabel="acceptance rate (fraction accepted)", ylim=(0, 1.1), xticks=positions)
    return fig


def _length_bins(lengths: np.ndarray, max_new_tokens: int | None) -> np.ndarray:
    """Bins of a whole number of tokens each (no aliasing between bins), at most ~50 of them."""
    top = max(int(lengths.max()), max_new_tokens or 0, 1) + 1
    width = math.ceil(top / 50)
    return np.arange(0, top + width, width)


def response_length_hist(lengths: list[int], max_new_tokens: int | None = None) -> Figure:
    """Histogram of response lengths with p50 / p90 / max marked, and the length limit if given.

    The y axis is logarithmic when the tallest bin is >= 20x the shortest non-empty one, so the
    few long responses that dominate rollout time (the long tail) stay visible.
    """
    title = "Response length distribution"
    if len(lengths) == 0:
        return _no_data_figure(title)
    arr = np.asarray(lengths, float)
    fig, axes = new_figure()
    ax = axes[0, 0]
    counts, _, _ = ax.hist(arr, bins=_length_bins(arr, max_new_tokens), color="tab:blue", alpha=0.8)
    marks = {"p50": np.percentile(arr, 50), "p90": np.percentile(arr, 90), "max": arr.max()}
    for (name, value), color in zip(marks.items(), ("tab:green", "tab:orange", "tab:red")):
        ax.axvline(value, color=color, linestyle="--", label=f"{name} = {value:.0f}")
    if max_new_tokens is not None:
        capped = int((arr >= max_new_tokens).sum())
        ax.axvline(max_new_tokens, color="black", linestyle=":",
                   label=f"limit = {max_new_tokens} ({capped} truncated)")
    nonzero = counts[counts > 0]
    if nonzero.size and nonzero.max() >= 20 * nonzero.min():
        ax.set_yscale("log")
    ax.set(title=f"{title} (n = {arr.size})", xlabel="response length (tokens)", ylabel="responses (count)")
    ax.legend(fontsize=8)
    return fig


def _stage_times(timings: dict[str, float]) -> tuple[dict[str, float], float | None]:
    """Positive per-stage times in STAGES order (prefix `timing_s/` optional) and the step total."""
    plain = {k.removeprefix("timing_s/"): float(v) for k, v in timings.items()}
    total = plain.pop("step", None)
    order = [s for s in STAGES if s in plain] + [s for s in plain if s not in STAGES]
    stages = {s: plain[s] for s in order if plain[s] > 0 and not math.isnan(plain[s])}
    return stages, total


def time_breakdown(timings: dict[str, float]) -> Figure:
    """One horizontal stacked bar: seconds per stage (`timing_s/*`), share of the total in the legend.

    When `timing_s/step` is given, the time it has beyond the listed stages shows as "other".
    """
    title = "Time per stage of an RL step"
    stages, total = _stage_times(timings)
    if total is not None and total - sum(stages.values()) > 1e-9:
        stages["other"] = total - sum(stages.values())
    if not stages:
        return _no_data_figure(title)
    whole = sum(stages.values())
    fig, axes = new_figure(height=3.0)
    ax = axes[0, 0]
    left = 0.0
    colors = [f"C{i % 10}" for i in range(len(stages))]
    for (stage, seconds), color in zip(stages.items(), colors):
        ax.barh([0], [seconds], left=left, color=color, label=f"{stage}: {seconds:.2f} s ({seconds / whole:.0%})")
        left += seconds
    ax.set(title=f"{title} (total {whole:.2f} s)", xlabel="time (s)", yticks=[])
    fig.legend(loc="outside lower center", ncols=min(3, len(stages)), fontsize=8)
    return fig


def draw_curves(ax: Axes, series: dict[str, list[tuple[int, float]]], title: str, ylabel: str) -> int:
    """Plot one line per non-empty series {label: [(step, value), ...]} on `ax`; returns the lines drawn.

    A label keeps its colour (its position in `series`) even when other series are empty, so
    one run has one colour in every panel of a grid.
    """
    colors = {label: f"C{i % 10}" for i, label in enumerate(series)}
    series = {label: sorted(points) for label, points in series.items() if points}
    if not series:
        mark_no_data(ax, title)
        return 0
    for label, points in series.items():
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) <= 30 else None, markersize=3, label=label,
                color=colors[label])
    ax.set(title=title, xlabel="RL step", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return len(series)


def _shared_label(keys: list[str]) -> str:
    """The y label of several metrics: the metric itself, or "value (unit)" when they share a unit."""
    if len(keys) == 1:
        return axis_label(keys[0])
    units = {metric_unit(k) for k in keys}
    return f"value ({units.pop()})" if len(units) == 1 and "" not in units else "value"


def curves(history: dict[str, list[tuple[int, float]]], title: str) -> Figure:
    """One line per metric vs RL step, e.g. {"reward/mean": [(0, 0.1), (1, 0.3)], "eval/accuracy": [...]}."""
    fig, axes = new_figure()
    draw_curves(axes[0, 0], history, title, _shared_label(list(history)))
    return fig


def accept_vs_drift(drift: list[float], arms: dict[str, list[float]], kl: list[float] | None = None) -> Figure:
    """Accept length of each drafter arm {name: [per policy snapshot]} against the policy's drift
    (share of greedy tokens changed since step 0, one value per snapshot), and per RL step."""
    fig, axes = new_figure(10.0, 4.0, ncols=2)
    left, right = axes[0, 0], axes[0, 1]
    if not drift or not any(arms.values()):
        mark_no_data(left, "accept length vs drift")
        mark_no_data(right, "accept length per RL step")
        return fig
    for i, (name, values) in enumerate(arms.items()):
        left.plot(drift[: len(values)], values, marker="o", markersize=4, label=name, color=f"C{i % 10}")
        right.plot(range(len(values)), values, marker="o", markersize=4, label=name, color=f"C{i % 10}")
    left.set(title="accept length vs policy drift", xlabel="greedy tokens changed since step 0 (fraction)",
             ylabel="accept length (tokens)")
    right.set(title="accept length per RL step", xlabel="RL step", ylabel="accept length (tokens)")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    if kl:
        twin = right.twinx()
        twin.plot(range(len(kl)), kl, ls="--", color="0.5", label="KL(π_t ‖ π_0)")
        twin.set_ylabel("KL(π_t ‖ π_0) per token (nats)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig
