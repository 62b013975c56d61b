"""Save and restore everything an RL run needs to continue exactly where it stopped.

With the tuner off (its choices depend on wall-clock) and the sequential drafter refresh (the
spot trainer trains for as long as the rollout's tail lasts), a run resumed from a checkpoint
ends bitwise equal on CPU to one that never stopped: the drafter buffer's contents and the
refresher's RNG are saved too, not only the weights and optimizers.
"""
from __future__ import annotations

import logging
from pathlib import Path

from tlt.checkpoint import (capture_rng, drop_blobs, load_checkpoint, load_pt, newest_verified, restore_rng,
                            save_checkpoint, torch_blob)
from tlt.faults import fault
from tlt.versions import write_weights

log = logging.getLogger(__name__)


def _crash_point(write, step: int):
    """A blob writer that hits the `checkpoint` fault point after writing (crash tests only)."""
    def run(path: Path) -> None:
        write(path)
        fault("checkpoint", step)
    return run


def steps_done(state: dict) -> int:
    """RL steps a checkpoint's state has completed. Its folder, `step-NNNNNN`, carries the same count
    (RL steps are counted from 1 in messages, metrics, Prefect task names and folders); checkpoints
    written before that convention named the 0-based index of their last step and lack the key."""
    return int(state["steps_done"]) if "steps_done" in state else int(state["step"]) + 1


def save_run_state(ctx, step: int, root: Path, keep: int, extra: dict | None = None,
                   optimizer_keep: int | None = None) -> Path:
    """Checkpoint after RL step `step` (0-based index; the folder is `step-{step + 1:06d}`): policy +
    optimizer, sampler cursor, RNG states, the engine's
    `state_dict()` under "engine" (its bandit, where it holds one), the drafter refresher's
    `state_dict()` (trainable weights, optimizer, buffer, RNG), `extra` (e.g. the step's metrics,
    which the pipeline logs after the save: see `checkpoint_metrics`). `optimizer_keep`: the newest
    checkpoints that keep the policy's optimizer state (trainer.optimizer_keep; None: all)."""
    tensors = {"policy": ctx.model.state_dict()}
    blobs = {"policy_optim": _crash_point(torch_blob(ctx.updater.state_dict()), step)}
    state = {"steps_done": step + 1, "sampler": ctx.sampler.state(), "rng": capture_rng(), **(extra or {})}
    engine = ctx.engine.state_dict()
    if engine:
        state["engine"] = engine
    if ctx.refresher is not None:  # its weights where `tlt export` reads them, the rest (optimizer, buffer...) whole
        refresher = ctx.refresher.state_dict()
        tensors["drafter"] = refresher.pop("drafter")
        blobs["refresher"] = torch_blob(refresher)
    path = save_checkpoint(root, step + 1, tensors, state, blobs, keep=keep)
    if optimizer_keep is not None:  # twice the policy's size, and only a resume (from the newest) reads it
        drop_blobs(root, {"policy_optim"}, optimizer_keep)
    fault("checkpointed", step)
    return path


def restore_run_state(ctx, root: Path) -> dict | None:
    """Load the newest verified checkpoint under `root` into ctx; returns its state (None if none).

    Newer checkpoints that fail verification are skipped (warned in the log); their names are
    returned under `state["corrupt_skipped"]` for a metric."""
    path, skipped = newest_verified(root)
    if path is None:
        return None
    tensors, state, pts = load_checkpoint(path)
    state["corrupt_skipped"] = [p.name for p in skipped]
    write_weights(ctx.model, tensors["policy"])  # the refresher's load writes the drafter
    if "policy_optim" in pts:
        ctx.updater.load_state_dict(load_pt(pts["policy_optim"]))
    else:  # an older checkpoint (the newer ones failed verification) kept the weights only: trainer.optimizer_keep
        log.warning("checkpoint %s holds no optimizer state (trainer.optimizer_keep); the policy's optimizer "
                    "restarts from zero moments", path.name)
    ctx.sampler.load_state(state["sampler"])
    ctx.engine.load_state_dict(engine_state(state))
    if ctx.refresher is not None and "refresher" in pts:
        ctx.refresher.load_state_dict({"drafter": tensors["drafter"], **load_pt(pts["refresher"])})
    restore_rng(state["rng"])
    return state


def engine_state(state: dict) -> dict:
    """The engine's part of a checkpoint's state (`Engine.load_state_dict`'s input): its "engine" entry,
    else a top-level "tuner" (the bandit's state where older checkpoints keep it), else {}."""
    if "engine" in state:
        return state["engine"]
    return {"tuner": state["tuner"]} if "tuner" in state else {}


def checkpoint_metrics(state: dict | None) -> tuple[int, dict[str, float]] | None:
    """(MLflow step, metrics) of a restored checkpoint's RL step, when it carries them: the pipeline
    logs a step's metrics after its checkpoint, so a crash in between leaves them only here."""
    if not state or not state.get("metrics"):
        return None
    return steps_done(state), {k: float(v) for k, v in state["metrics"].items()}
