"""`tlt compare`: runs side by side, as a table and a grid of curves.

Reads MLflow through `tlt.tracking` only. Every number is computed from the stepped metric
histories with the project's metric names (docs/tracking.md: What a run produces), so runs of any recipe compare; a metric a run never logged
is NaN in the table and no line in the plot, never an error.
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from tlt import tracking
from tlt.errors import UserError
from tlt.inputs import resolve_run_id
from tlt.plots import axis_label, draw_curves, new_figure

SHORT = 8  # characters of a run id shown in tables and legends
KEYS = ("spec/accept_len/mean", "rollout/tokens_per_s", "perf/tokens_per_s", "perf/step_speedup_vs_plain",
        "eval/accuracy", "reward/mean", "timing_s/step", "timing_s/update_drafter", "spec/regret")
PLOTTED = ("reward/mean", "eval/accuracy", "spec/accept_len/mean", "timing_s/step")
# column -> (header, format); NaN prints as "-"
COLUMNS = {
    "run": ("run", "{}"), "name": ("name", "{}"), "status": ("status", "{}"),
    "accept_len": ("accept len", "{:.2f}"), "tokens_per_s": ("tokens/s", "{:.1f}"),
    "sd_speedup": ("SD speedup", "{:.2f}x"), "accuracy": ("accuracy", "{:.3f}"), "reward": ("reward", "{:.3f}"),
    "step_time_s": ("step time s", "{:.2f}"), "drafter_share": ("drafter share", "{:.1%}"), "steps": ("steps", "{:d}"),
    "regret_s": ("bandit regret s", "{:.2f}"),
}


def _values(points: list[tuple[int, float]]) -> list[float]:
    return [v for _, v in points]


def _last(points: list[tuple[int, float]]) -> float:
    return points[-1][1] if points else math.nan


def _mean(points: list[tuple[int, float]]) -> float:
    return sum(_values(points)) / len(points) if points else math.nan


def summarize(hist: dict[str, list[tuple[int, float]]]) -> dict[str, float | int]:
    """Table numbers of one run from its metric histories (see KEYS); pure, for tests and reuse.

    Last value for quality metrics (accept length, accuracy, reward), mean over steps for speed
    (tokens/s, SD speedup, step time); drafter share = sum(update_drafter) / sum(step), NaN when
    either was never logged; bandit regret = the last spec/regret (it is cumulative).
    """
    step_total = sum(_values(hist.get("timing_s/step", [])))
    drafter = hist.get("timing_s/update_drafter", [])
    tokens = hist.get("rollout/tokens_per_s") or hist.get("perf/tokens_per_s", [])
    counted = hist.get("timing_s/step") or hist.get("reward/mean", [])
    return {
        "accept_len": _last(hist.get("spec/accept_len/mean", [])),
        "tokens_per_s": _mean(tokens),
        "sd_speedup": _mean(hist.get("perf/step_speedup_vs_plain", [])),
        "accuracy": _last(hist.get("eval/accuracy", [])),
        "reward": _last(hist.get("reward/mean", [])),
        "step_time_s": _mean(hist.get("timing_s/step", [])),
        "drafter_share": sum(_values(drafter)) / step_total if drafter and step_total > 0 else math.nan,
        "steps": len(counted),
        "regret_s": _last(hist.get("spec/regret", [])),  # cumulative: the last value is the run's
    }


def resolve_run_ids(run_ids: list[str], uri: str | None = None) -> list[str]:
    """Full run ids for ids or unique id prefixes; UserError naming the first unknown or ambiguous one."""
    return list(dict.fromkeys(resolve_run_id(rid, uri) for rid in run_ids))  # de-duplicated, order kept


def experiment_run_ids(experiment: str, uri: str | None = None, max_runs: int | None = None) -> list[str]:
    """Run ids of an experiment, newest first; UserError when it is unknown or has no runs."""
    ids = tracking.search_runs(experiment, uri)
    if not ids:
        known = tracking.list_experiments(uri)
        raise UserError(f"experiment '{experiment}' has no runs in {tracking.default_tracking_uri(uri)}. "
                        f"Experiments there: {', '.join(known) or 'none'}.")
    return ids[:max_runs] if max_runs else ids


def compare_runs(run_ids: list[str], uri: str | None = None) -> pd.DataFrame:
    """One row per run: run (short id), name, status and the summary numbers (NaN when not logged).

    The full ids are in the `run_id` column; ids may be unique prefixes.
    """
    rows = []
    for rid in resolve_run_ids(run_ids, uri):
        info = tracking.read_run(rid, uri)
        rows.append({"run_id": rid, "run": rid[:SHORT], "name": info["name"] or "", "status": info["status"],
                     **summarize(tracking.metric_histories(rid, list(KEYS), uri))})
    return pd.DataFrame(rows, columns=["run_id", *COLUMNS])


def compare_plot(run_ids: list[str], uri: str | None = None) -> Figure:
    """2x2 grid: reward/mean, eval/accuracy, spec/accept_len/mean and timing_s/step vs step,
    one line per run labelled "name (short id)"."""
    ids = resolve_run_ids(run_ids, uri)
    labels = {rid: f"{tracking.read_run(rid, uri)['name'] or 'run'} ({rid[:SHORT]})" for rid in ids}
    hists = {rid: tracking.metric_histories(rid, list(PLOTTED), uri) for rid in ids}
    fig, axes = new_figure(width=11, height=7, nrows=2, ncols=2)
    for ax, key in zip(axes.flat, PLOTTED):
        draw_curves(ax, {labels[rid]: hists[rid][key] for rid in ids}, key, axis_label(key))
    fig.suptitle(f"Run comparison ({len(ids)} runs)")
    return fig


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(int(value) if fmt == "{:d}" else value)


def format_table(df: pd.DataFrame) -> str:
    """The comparison table as plain text (rich box drawing, no colour) for the terminal."""
    table = Table(show_lines=False)
    cols = [c for c in COLUMNS if c in df.columns]
    for c in cols:
        table.add_column(COLUMNS[c][0], justify="left" if c in ("run", "name", "status") else "right")
    for _, row in df.iterrows():
        table.add_row(*(_cell(row[c], COLUMNS[c][1]) for c in cols))
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None, force_terminal=False).print(table)
    return buf.getvalue().rstrip("\n")


def compare_command(run_ids: list[str], experiment: str | None = None, out: Path | None = None,
                    uri: str | None = None, max_runs: int = 20) -> str:
    """What `tlt compare RUN_ID... | --experiment NAME [--out PNG]` does: returns the table text and
    writes the plot to `out` when given. With an experiment, its `max_runs` newest runs join the ids."""
    if not run_ids and not experiment:
        raise UserError("give run ids (`tlt compare ID1 ID2`) or an experiment (`tlt compare --experiment NAME`).")
    ids = list(run_ids) + (experiment_run_ids(experiment, uri, max_runs) if experiment else [])
    ids = resolve_run_ids(ids, uri)
    text = format_table(compare_runs(ids, uri))
    for rid in ids:  # a run whose end fell in an outage: its numbers here are partial
        if msg := tracking.unsent_warning(rid, uri):
            text += f"\nwarning: {msg}"
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        compare_plot(ids, uri).savefig(out, dpi=120)
        text += f"\nplot: {out}"
    return text
