"""`tlt compare`: runs side by side, as a table and a grid of curves.

Reads MLflow through `tlt.tracking` only. Every number is computed from the stepped metric
histories with the project's metric names and vocabulary (docs/tracking.md: What a run produces;
held-out vs live accept length, rollout vs step tokens/s), so runs of any recipe compare; a metric
a run never logged is NaN in the table and no line in the plot, never an error.
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
from tlt.console import DRAFTER_KEYS, rows_by_step, trained_steps
from tlt.errors import UserError
from tlt.inputs import resolve_run_id
from tlt.plots import axis_label, draw_curves, new_figure

SHORT = 8  # characters of a run id shown in tables and legends
DRAFTER_SHARE = "drafter share"  # a derived series: timing_s/update_drafter / timing_s/step per step
# The plot's panels: title -> the metric drawn (docs/tracking.md names them the same way).
PANELS = {
    "reward": "reward/mean",
    "held-out accuracy": "eval/accuracy",
    "held-out accept length (fixed chain, greedy)": "eval/accept_len",
    "live accept length (rollout)": "spec/accept_len/mean",
    "rollout tokens/s": "rollout/tokens_per_s",
    "step tokens/s": "perf/tokens_per_s",
    "RL step time": "timing_s/step",
    "drafter share of the step": DRAFTER_SHARE,
}
KEYS = ("reward/mean", "eval/accuracy", "eval/accept_len", "eval/accept_len_sampled", "spec/accept_len/mean",
        "rollout/tokens_per_s", "perf/tokens_per_s", "timing_s/step", "timing_s/update_drafter",
        "drafter/refresh_decision", "drafter/spot_steps", "drafter/steps", "spec/regret")
# column -> (header, format); NaN prints as "-"
COLUMNS = {
    "run": ("run", "{}"), "name": ("name", "{}"), "status": ("status", "{}"),
    "accuracy": ("held-out accuracy", "{:.3f}"), "reward": ("reward", "{:.3f}"),
    "accept_len_heldout": ("held-out accept len (greedy)", "{:.2f}"),
    "accept_len_heldout_sampled": ("held-out accept len (sampled)", "{:.2f}"),
    "accept_len_live": ("live accept len", "{:.2f}"),
    "rollout_tokens_per_s": ("rollout tok/s", "{:.1f}"), "step_tokens_per_s": ("step tok/s", "{:.1f}"),
    "step_time_s": ("step time s", "{:.2f}"), "refreshes": ("drafter refreshes", "{:d}"),
    "drafter_share": ("drafter share", "{:.1%}"), "steps": ("steps", "{:d}"),
    "regret_s": ("bandit regret s", "{:.2f}"),
}


def _values(points: list[tuple[int, float]]) -> list[float]:
    return [v for _, v in points]


def _last(points: list[tuple[int, float]]) -> float:
    return points[-1][1] if points else math.nan


def _mean(points: list[tuple[int, float]]) -> float:
    return sum(_values(points)) / len(points) if points else math.nan


def drafter_share(hist: dict[str, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Per step: the drafter's update time over the step time (steps that logged both)."""
    step_s = dict(hist.get("timing_s/step", []))
    return [(s, v / step_s[s]) for s, v in hist.get("timing_s/update_drafter", []) if step_s.get(s)]


def refreshes(hist: dict[str, list[tuple[int, float]]]) -> float:
    """RL steps in which the drafter trained (tlt.console's count; NaN: the run logged no decisions)."""
    rows = rows_by_step({k: hist.get(k, []) for k in DRAFTER_KEYS})
    decided = [r for r in rows if "drafter/refresh_decision" in r]
    if not decided:
        return math.nan
    return float(sum(r["drafter/refresh_decision"] > 0 and trained_steps(r, p) != 0
                     for p, r in zip([None, *decided[:-1]], decided)))


def summarize(hist: dict[str, list[tuple[int, float]]]) -> dict[str, float | int]:
    """Table numbers of one run from its metric histories (see KEYS); pure, for tests and reuse.

    Last value for quality (accuracy, reward, the held-out accept lengths of the last evaluation);
    mean over the RL steps for the live accept length, throughput and step time; drafter share =
    sum(update_drafter) / sum(step), NaN when either was never logged. Nothing is computed from a
    metric the run did not log (there is no SD speedup column: a run logs no plain-decoding
    baseline; `tlt bench` measures that ratio); bandit regret = the last spec/regret (it is cumulative).
    """
    step_total = sum(_values(hist.get("timing_s/step", [])))
    drafter = hist.get("timing_s/update_drafter", [])
    counted = hist.get("timing_s/step") or hist.get("reward/mean", [])
    return {
        "accuracy": _last(hist.get("eval/accuracy", [])),
        "reward": _last(hist.get("reward/mean", [])),
        "accept_len_heldout": _last(hist.get("eval/accept_len", [])),
        "accept_len_heldout_sampled": _last(hist.get("eval/accept_len_sampled", [])),
        "accept_len_live": _mean(hist.get("spec/accept_len/mean", [])),
        "rollout_tokens_per_s": _mean(hist.get("rollout/tokens_per_s", [])),
        "step_tokens_per_s": _mean(hist.get("perf/tokens_per_s", [])),
        "step_time_s": _mean(hist.get("timing_s/step", [])),
        "refreshes": refreshes(hist),
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
    """2x4 grid, one panel per PANELS entry (reward, held-out accuracy, held-out and live accept
    length, rollout and step tokens/s, step time, drafter share) vs RL step, one line per run
    labelled "name (short id)"."""
    ids = resolve_run_ids(run_ids, uri)
    labels = {rid: f"{tracking.read_run(rid, uri)['name'] or 'run'} ({rid[:SHORT]})" for rid in ids}
    hists = {rid: tracking.metric_histories(rid, list(KEYS), uri) for rid in ids}
    for h in hists.values():
        h[DRAFTER_SHARE] = drafter_share(h)
    fig, axes = new_figure(width=16, height=7, nrows=2, ncols=4)
    for ax, (title, key) in zip(axes.flat, PANELS.items()):
        ylabel = "fraction of the step" if key == DRAFTER_SHARE else axis_label(key)
        draw_curves(ax, {labels[rid]: hists[rid][key] for rid in ids}, title, ylabel)
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
        table.add_column(COLUMNS[c][0], justify="left" if c in ("run", "name", "status") else "right", no_wrap=True)
    for _, row in df.iterrows():
        table.add_row(*(_cell(row[c], COLUMNS[c][1]) for c in cols))
    buf = io.StringIO()
    Console(file=buf, width=400, color_system=None, force_terminal=False).print(table)
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
