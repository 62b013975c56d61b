"""Save and restore everything an RL run needs to continue exactly where it stopped."""
from __future__ import annotations

from pathlib import Path

from tlt.checkpoint import (capture_rng, latest_checkpoint, load_checkpoint, load_pt, restore_rng, save_checkpoint,
                            torch_blob)


def save_run_state(ctx, step: int, root: Path, keep: int, extra: dict | None = None) -> Path:
    """Checkpoint after RL step `step`: policy + optimizer, drafter (trainable only) + optimizer,
    sampler cursor, RNG states, tuner state, buffer metadata, `extra` (e.g. the step's metrics)."""
    tensors = {"policy": ctx.model.state_dict()}
    blobs = {"policy_optim": torch_blob(ctx.updater.state_dict())}
    state = {"step": step, "sampler": ctx.sampler.state(), "rng": capture_rng(), **(extra or {})}
    if ctx.engine.tuner is not None:
        state["tuner"] = ctx.engine.tuner.state()
    if ctx.refresher is not None:
        tensors["drafter"] = ctx.refresher.drafter.trainable_state_dict()
        blobs["drafter_optim"] = torch_blob({"optimizer": ctx.refresher.trainer.opt.state_dict(),
                                             "num_steps": ctx.refresher.trainer.num_steps})
        state["buffer"] = ctx.refresher.buffer.metadata()
        state["drafter_total_steps"] = ctx.refresher.total_steps
    return save_checkpoint(root, step, tensors, state, blobs, keep=keep)


def restore_run_state(ctx, root: Path) -> dict | None:
    """Load the newest verified checkpoint under `root` into ctx; returns its state (None if none)."""
    path = latest_checkpoint(root)
    if path is None:
        return None
    tensors, state, pts = load_checkpoint(path)
    ctx.model.load_state_dict(tensors["policy"], strict=True)
    ctx.updater.load_state_dict(load_pt(pts["policy_optim"]))
    ctx.sampler.load_state(state["sampler"])
    if ctx.engine.tuner is not None and "tuner" in state:
        ctx.engine.tuner.load_state(state["tuner"])
    if ctx.refresher is not None and "drafter" in tensors:
        ctx.refresher.drafter.load_state_dict(tensors["drafter"], strict=True)
        opt = load_pt(pts["drafter_optim"])
        ctx.refresher.trainer.opt.load_state_dict(opt["optimizer"])
        ctx.refresher.trainer.num_steps = opt["num_steps"]
        ctx.refresher.total_steps = state.get("drafter_total_steps", 0)
    restore_rng(state["rng"])
    return state
