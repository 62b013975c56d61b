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
