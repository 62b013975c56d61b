"""What a run says on the console: one line per RL step and per evaluation, and the final summary
of the drafter's refreshes. Pure functions of the logged metrics (a step's `dict[str, float]`, as
logged to MLflow), so the live run and `tlt run`'s closing lines read the same numbers.

The names follow the vocabulary of docs/tracking.md: the *live accept length* is the rollout's own
(`spec/accept_len/mean`), the *held-out accept length* the fixed-chain measurement of an
evaluation (`eval/accept_len`, greedy; `eval/accept_len_sampled`); *rollout tokens/s* counts the
rollout's time only (`rollout/tokens_per_s`), *step tokens/s* the whole RL step's
(`perf/tokens_per_s`).
"""
from __future__ import annotations

import os
from collections import Counter

from tlt import tracking

# The metrics these lines read (tlt compare and `tlt run` fetch them from MLflow).
DRAFTER_KEYS = ("drafter/refresh_decision", "drafter/payoff_s", "drafter/spot_steps", "drafter/steps",
                "spec/accept_len/mean")

EMPTY_TAIL = "due, trained 0 steps (empty buffer or no tail)"


def trained_steps(m: dict, prev: dict | None) -> int | None:
    """Drafter optimizer steps taken in this RL step: the spot trainer's count of this tail, else the
    growth of the sequential refresher's running total (None: not known, e.g. the first step after a
    resume)."""
    if "drafter/spot_steps" in m:
        return int(m["drafter/spot_steps"])
    if "drafter/steps" not in m:
        return 0 if m.get("drafter/refresh_decision", 0.0) == 0.0 else None
    before = (prev or {}).get("drafter/steps")
    return None if before is None else int(m["drafter/steps"] - before)


def skip_reason(m: dict, prev: dict | None, drafter) -> str:
    """Why the schedule (`drafter`: the run's DrafterConfig) did not train the drafter in this step."""
    s = drafter.schedule
    if s == "frozen":
        return "frozen (drafter.schedule: frozen)"
    if s == "every_k":
        return f"not due (every {drafter.refresh_every} steps)"
    if s == "below_accept":
        live = (prev or {}).get("spec/accept_len/mean")
        seen = f"live accept length {live:.2f}" if live is not None else "no live accept length yet"
        return f"{seen} ≥ {drafter.refresh_below_accept_len:g}" if live is not None else seen
    payoff = m.get("drafter/payoff_s")
    if payoff is None:
        return "no payoff estimate yet (needs a rollout with SD)"
    if payoff <= 0:
        return f"payoff {payoff:+.1f} s ≤ 0"
    return "waiting to measure the last refresh"


def drafter_note(m: dict, prev: dict | None, drafter) -> str:
    """`trained N steps` / `skipped (reason)` for one RL step; '' for a run without a trained drafter."""
    if drafter is None or "drafter/refresh_decision" not in m:
        return ""
    n = trained_steps(m, prev)
    if m["drafter/refresh_decision"] > 0:
        if n == 0:
            return EMPTY_TAIL
        return "trained" + (f" {_steps(n)}" if n is not None else "")
    return f"skipped ({skip_reason(m, prev, drafter)})"


def step_line(step: int, total: int, m: dict, prev: dict | None = None, drafter=None) -> str:
    """One RL step (1-based `step` of `total`) as one line."""
    parts = [f"reward {m.get('reward/mean', float('nan')):.3f}"]
    if "rollout/tokens_per_s" in m:
        parts.append(f"rollout {m['rollout/tokens_per_s']:.1f} tok/s"
                     + (f" (step {m['perf/tokens_per_s']:.1f} tok/s)" if "perf/tokens_per_s" in m else ""))
    if "spec/enabled_share" in m:
        parts.append(f"SD share {m['spec/enabled_share']:.0%}")
    if "spec/accept_len/mean" in m:
        parts.append(f"live accept length {m['spec/accept_len/mean']:.2f}")
    if "timing_s/step" in m:
        parts.append(f"{m['timing_s/step']:.1f} s")
    line = f"RL step {step}/{total}: " + ", ".join(parts)
    note = drafter_note(m, prev, drafter)
    return f"{line}; drafter {note}" if note else line


def eval_line(step: int, accuracy: float, n: int, accept_len: float | None = None,
              accept_len_sampled: float | None = None) -> str:
    """An evaluation after `step` RL steps (0: before training)."""
    when = "before training" if step == 0 else f"after RL step {step}"
    line = f"evaluation {when}: held-out accuracy {accuracy:.3f} ({n} prompts)"
    if accept_len is not None:
        line += f", held-out accept length (fixed chain) greedy {accept_len:.2f}"
        if accept_len_sampled is not None:
            line += f", sampled {accept_len_sampled:.2f}"
    return line


def rows_by_step(histories: dict[str, list[tuple[int, float]]]) -> list[dict]:
    """Metric histories ({key: [(step, value)]}) as one dict per step, with "step", oldest first."""
    rows: dict[int, dict] = {}
    for key, points in histories.items():
        for step, value in points:
            rows.setdefault(step, {"step": step})[key] = value
    return [rows[s] for s in sorted(rows)]


def refresh_summary(history: list[dict], drafter) -> str:
    """How many RL steps refreshed the drafter and why the others did not, from the per-step rows
    (each with "step"); '' when the run has no trained drafter."""
    rows = [h for h in history if "drafter/refresh_decision" in h]
    if drafter is None or not rows:
        return ""
    done, skipped, steps = [], Counter(), 0
    for prev, m in zip([None, *rows[:-1]], rows):
        n = trained_steps(m, prev)
        if m["drafter/refresh_decision"] > 0 and n != 0:
            done.append(m["step"])
            steps += n or 0
        else:
            reason = EMPTY_TAIL if m["drafter/refresh_decision"] > 0 else skip_reason(m, prev, drafter)
            skipped[_category(reason)] += 1
    line = f"drafter refreshes: {len(done)} of {len(rows)} RL steps (schedule {drafter.schedule}"
    line += f", {drafter.where})" if drafter.schedule != "frozen" else ")"
    if done:
        line += f", at step{'s' * (len(done) > 1)} {', '.join(map(str, done))}" + (f" ({_steps(steps)})" if steps else "")
    if skipped:
        line += "; skipped: " + ", ".join(f"{why} ×{k}" for why, k in skipped.most_common())
    return line


def run_refresh_summary(run_id: str, uri: str | None, drafter, fallback: list[dict] | None = None) -> str:
    """`refresh_summary` of a whole run, read back from its MLflow metrics (a resumed run's earlier
    steps count too); during an outage, of `fallback` (this process's rows), else ''."""
    try:
        history = rows_by_step(tracking.metric_histories(run_id, list(DRAFTER_KEYS), uri))
    except Exception as exc:  # noqa: BLE001 - an outage costs this line only (the run itself is done)
        if not tracking.is_transient(exc):
            raise
        history = fallback or []
    return refresh_summary(history, drafter)


def _steps(n: int) -> str:
    return f"{n} drafter step{'s' * (n != 1)}"


def _category(reason: str) -> str:
    """A skip reason without its per-step number, for counting (`payoff -0.9 s ≤ 0` -> `payoff ≤ 0`)."""
    if reason.startswith("payoff "):
        return "payoff ≤ 0"
    if reason.startswith("live accept length"):
        return "live accept length above the bound"
    return reason


def starting_line(cfg, resume: str | None) -> str:
    """`tlt run`'s line before the flow starts (Prefect's temporary server takes seconds to come up)."""
    api = os.environ.get("PREFECT_API_URL")
    prefect = f"the Prefect server at {api}" if api else "Prefect's temporary local server (~10-20 s)"
    what = f"resuming MLflow run {resume}" if resume else f"a new MLflow run in experiment '{cfg.tracking.experiment}'"
    return f"starting {prefect}, then {what} in {tracking.default_tracking_uri(cfg.tracking.tracking_uri)}"


def final_line(ev: dict, ex: dict | None, model_name: str = "tlt-model") -> str:
    """The final evaluation (an EvalSummary's fields) and the export (an ExportSummary's), in the
    project's vocabulary. A run that exports measures its held-out accept lengths on the exported
    folder (the export's figures), not in the final evaluation."""
    line = f"held-out accuracy {ev['accuracy']:.3f} after RL step {ev['step']} ({ev['n']} prompts)"
    figures = ex if ex and ex.get("accept_len") else ev
    if figures.get("accept_len"):
        line += f", held-out accept length (fixed chain) greedy {figures['accept_len']:.2f}"
        if figures.get("accept_len_sampled"):
            line += f", sampled {figures['accept_len_sampled']:.2f}"
    if ex:
        line += f"; model exported to {ex['path']}" + (f" ({model_name} version {ex['version']})"
                                                       if ex.get("version") else "")
    return line


def closing_lines(result: dict, cfg) -> list[str]:
    """`tlt run`'s last lines: the final evaluation and export, what the drafter's refresh schedule
    did (read back from the run's metrics, so a resumed run counts its earlier steps too), and where
    the run is."""
    ex = result.get("export")
    lines = [final_line(result["eval"], ex, cfg.export.model_name)]
    if ex and ex.get("serve"):
        lines.append(f"serve it: {ex['serve']}")
    run_id, uri = result["run_id"], cfg.tracking.tracking_uri
    if cfg.rollout.drafter == "eagle" and (summary := run_refresh_summary(run_id, uri, cfg.drafter)):
        lines.append(summary)
    link = tracking.run_link(run_id, uri)
    where = f"open {link}" if link else f"open the experiment '{cfg.tracking.experiment}'"
    local = not tracking.default_tracking_uri(uri).startswith(("http://", "https://"))
    lines.append(f"done: MLflow run {run_id}  ({'make ui, then ' if local else ''}{where})")
    return lines
