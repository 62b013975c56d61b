"""Stage 4: the RL steps (tlt.rl.step) with their checkpoints, metrics, rollout tables and run
record, and the resume from the newest verified checkpoint."""
from __future__ import annotations

import time
from pathlib import Path

from tlt.report import RunRecord
from tlt.rl.resume import checkpoint_metrics, restore_run_state, save_run_state, steps_done
from tlt.rl.step import StepContext
from tlt.rl.step import rl_step as run_rl_step
from tlt.summaries import StepSummary


def resume(ctx: StepContext, run_dir: Path, tracker) -> int:
    """Restore the newest verified checkpoint under `run_dir`; returns the first step still to run."""
    state = restore_run_state(ctx, run_dir / "checkpoints")
    logged = checkpoint_metrics(state)
    if logged:  # a crash between the save and the log: the tracker skips (key, step)s the run has
        tracker.log_metrics(logged[1], step=logged[0])
    if state is not None and state["corrupt_skipped"]:  # newer checkpoints failed their checksums
        tracker.log_metrics({"checkpoint/corrupt_skipped": float(len(state["corrupt_skipped"]))},
                            step=steps_done(state))
    return 0 if state is None else steps_done(state)


def rl_step(ctx: StepContext, step: int, run_dir: Path, tracker, record: RunRecord) -> tuple[StepSummary, Path | None]:
    """RL step `step`, checkpointed when due, logged at step + 1 and added to `record`; returns its
    summary (with the rollout samples) and the checkpoint it wrote (None: none due)."""
    cfg = ctx.cfg
    result = run_rl_step(ctx, step)
    metrics, saved = result.metrics, None
    if (step + 1) % cfg.trainer.checkpoint_every == 0 or step + 1 == cfg.rl.steps:
        t0 = time.perf_counter()
        saved = save_run_state(ctx, step, run_dir / "checkpoints", cfg.trainer.checkpoint_keep,
                               extra={"metrics": {k: float(v) for k, v in metrics.items()}},
                               optimizer_keep=cfg.trainer.optimizer_keep)
        metrics["timing_s/checkpoint"] = time.perf_counter() - t0
    tracker.log_metrics(metrics, step=step + 1)
    record.add_step(step + 1, metrics, result.batch)
    every = cfg.tracking.samples_every
    if every and (step + 1) % every == 0:
        tracker.log_table(result.samples, f"rollouts/step_{step + 1:04d}.json")
    summary = StepSummary(step=step + 1, reward_mean=metrics["reward/mean"],
                          accept_len=metrics.get("spec/accept_len/mean"), step_s=metrics["timing_s/step"],
                          metrics={k: float(v) for k, v in metrics.items()}, samples=result.samples)
    return summary, saved
