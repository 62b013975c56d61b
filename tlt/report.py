"""Run-level report: plots logged to MLflow and a markdown summary for the Prefect artifact."""
from __future__ import annotations

from dataclasses import dataclass, field

from tlt import plots


@dataclass
class RunRecord:
    """What the report needs, accumulated over the RL steps (no tensors)."""

    history: list[dict] = field(default_factory=list)  # {"step": n, metric: value, ...}
    lengths: list[int] = field(default_factory=list)
    accepted_pos: list[float] = field(default_factory=list)
    drafted_pos: list[float] = field(default_factory=list)

    def add_step(self, step: int, metrics: dict, batch) -> None:
        self.history.append({"step": step, **metrics})
        self.lengths += [len(r) for r in batch.response_ids]
        for new, acc in ((batch.stats.accepted_pos, self.accepted_pos), (batch.stats.drafted_pos, self.drafted_pos)):
            acc.extend([0.0] * (len(new) - len(acc)))
            for i, v in enumerate(new):
                acc[i] += float(v)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(h["step"], h[key]) for h in self.history if key in h]


def log_report(rec: RunRecord, evals: list[tuple[int, float]], tracker, max_new_tokens: int) -> str:
    """Log the run's plots to `tracker` under plots/ and return a markdown summary."""
    timings = {}
    for h in rec.history:
        for k, v in h.items():
            if k.startswith("timing_s/"):
                timings[k] = timings.get(k, 0.0) + v
    figs = {
        "plots/acceptance_by_position.png": plots.acceptance_by_position(rec.accepted_pos, rec.drafted_pos),
        "plots/response_length_hist.png": plots.response_length_hist(rec.lengths, max_new_tokens),
        "plots/time_breakdown.png": plots.time_breakdown(timings),
        "plots/reward_accuracy.png": plots.curves({"reward/mean": rec.series("reward/mean"), "eval/accuracy": evals},
                                                  "reward and held-out accuracy"),
        "plots/accept_len.png": plots.curves({"spec/accept_len/mean": rec.series("spec/accept_len/mean")},
                                             "accept length (tokens per target pass in SD)"),
    }
    for path, fig in figs.items():
        tracker.log_figure(fig, path)
    total = timings.get("timing_s/step", 0.0) or 1.0
    lines = ["| step | reward | accept len | SD share | step s |", "|---|---|---|---|---|"]
    for h in rec.history:
        lines.append(f"| {h['step']} | {h.get('reward/mean', float('nan')):.3f} | {h.get('spec/accept_len/mean', float('nan')):.2f} "
                     f"| {h.get('spec/enabled_share', 0):.2f} | {h.get('timing_s/step', 0):.1f} |")
    shares = ", ".join(f"{k.split('/')[1]} {100 * v / total:.0f}%" for k, v in timings.items() if k != "timing_s/step")
    evals_md = ", ".join(f"step {s}: {v:.3f}" for s, v in evals)
    return "\n".join(["## tlt run report", "", *lines, "", f"**time share**: {shares}", "",
                      f"**held-out accuracy**: {evals_md}"])


# The run's headline numbers, logged once at its end as unstepped `summary/*` metrics (MLflow's run list
# can show them as columns; docs/tracking.md) and as the run's description (`mlflow.note.content`, the
# first thing on MLflow's run page). Names follow the vocabulary of docs/tracking.md.
HEADLINE = {  # summary metric -> (compare.summarize key, label, format)
    "summary/heldout_accuracy": ("accuracy", "held-out accuracy", "{:.3f}"),
    "summary/heldout_accept_len_greedy": ("accept_len_heldout", "held-out accept length (fixed chain, greedy)", "{:.2f}"),
    "summary/heldout_accept_len_sampled": ("accept_len_heldout_sampled", "held-out accept length (fixed chain, "
                                           "sampled)", "{:.2f}"),
    "summary/live_accept_len": ("accept_len_live", "live accept length (rollout, mean over steps)", "{:.2f}"),
    "summary/rollout_tokens_per_s": ("rollout_tokens_per_s", "rollout tokens/s (mean)", "{:.1f}"),
    "summary/step_tokens_per_s": ("step_tokens_per_s", "step tokens/s (mean)", "{:.1f}"),
    "summary/step_time_s": ("step_time_s", "RL step time s (mean)", "{:.2f}"),
    "summary/drafter_refreshes": ("refreshes", "drafter refreshes", "{:.0f}"),
}


def headline(numbers: dict) -> tuple[dict[str, float], str]:
    """(summary metrics, markdown description) from `tlt.compare.summarize`'s numbers; NaNs left out."""
    metrics = {k: float(numbers[src]) for k, (src, _, _) in HEADLINE.items() if numbers[src] == numbers[src]}
    rows = [f"| {label} | {fmt.format(numbers[src])} |" for k, (src, label, fmt) in HEADLINE.items() if k in metrics]
    text = "\n".join(["**tlt run summary** (metrics `summary/*`; the vocabulary: docs/tracking.md)", "",
                      "| | |", "|---|---|", *rows])
    return metrics, text


def log_summary(tracker, extra: str = "") -> dict[str, float]:
    """Log the run's headline metrics and description, read back from the run's own metric histories
    (so a resumed run counts its earlier steps). A tracker without a store (NullTracker) logs nothing;
    an outage costs the summary only."""
    if getattr(tracker, "uri", None) is None or not tracker.run_id:
        return {}
    from tlt import tracking
    from tlt.compare import KEYS, summarize  # deferred: pandas, rich

    try:
        numbers = summarize(tracking.metric_histories(tracker.run_id, list(KEYS), tracker.uri))
    except Exception as err:  # noqa: BLE001 - see docstring
        if not tracking.is_transient(err):
            raise
        return {}
    metrics, text = headline(numbers)
    tracker.log_metrics(metrics)
    tracker.set_tags({"mlflow.note.content": text + (f"\n\n{extra}" if extra else "")})
    return metrics


def close_report(md: str, tracker, cfg, history: list[dict], trains_drafter: bool) -> tuple[str, str]:
    """The run report `md` with the drafter's refresh summary and the headline metrics added (both
    logged to the run: tlt.console.run_refresh_summary, `log_summary`); returns (report, refresh line)."""
    from tlt.console import run_refresh_summary

    uri = getattr(tracker, "uri", None)  # None: a NullTracker, no store to read the run back from
    refreshes = run_refresh_summary(tracker.run_id, uri, cfg.drafter, history) if trains_drafter and uri else ""
    if refreshes:
        md += f"\n\n**{refreshes}**"
    summary = log_summary(tracker, refreshes)
    if summary:
        md += "\n\n**summary metrics**: " + ", ".join(f"`{k}` {v:.3g}" for k, v in summary.items())
    return md, refreshes
