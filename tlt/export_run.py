"""`tlt export`: the model folder of a finished (or running) training run, by MLflow run id or
checkpoint folder: the checkpoint's policy and drafter rebuilt from the run's config.yaml, written
as policy/ + drafter/ + README.md (tlt.model_folder), figures measured on the written folder."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from tlt.arch import require_vllm_eagle3
from tlt.preflight import target_config
from tlt.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from tlt.config import load_config
from tlt.drafter.model import build_drafter
from tlt.errors import UserError
from tlt.drafter.eagle3 import ExportError
from tlt.models import eos_token_ids, load_target
from tlt.rl.resume import steps_done
from tlt.stages.export import base_figures, write_and_measure
from tlt.versions import write_weights


def resolve_checkpoint(run_id: str | None, checkpoint: str | Path | None, checkpoint_root: str = "runs") -> Path:
    """A verified checkpoint dir from `--checkpoint DIR` (a step dir or a run dir) or `--run RUN_ID`."""
    if (run_id is None) == (checkpoint is None):
        raise UserError("give exactly one of --run RUN_ID or --checkpoint DIR")
    if checkpoint is not None:
        path = Path(checkpoint)
        if (path / "MANIFEST.json").exists():
            return path
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    else:
        root = Path(checkpoint_root) / run_id / "checkpoints"
    found = latest_checkpoint(root) if root.is_dir() else None
    if found is None:
        raise UserError(f"no complete checkpoint under '{root}'; pass --checkpoint with a run's step-NNNNNN folder "
                        "(runs/<run id>/checkpoints/...) or the --run id of a run that finished at least one RL step")
    return found


def _load_strict(module, state: dict, what: str, ckpt: Path) -> None:
    try:
        write_weights(module, state)
    except RuntimeError as err:
        first = next((ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()), str(err))
        raise ExportError(f"checkpoint '{ckpt}': its {what} does not fit the model its run's config.yaml builds "
                          f"({first}). The {what} and the config must come from the same run: pass that run's "
                          "checkpoint folder, or restore its config.yaml.") from None


def rebuild(ckpt: Path, what: str = "both"):
    """(config, policy, tokenizer, drafter or None, checkpoint state) of a checkpoint, the policy and
    drafter checked against the shapes the run's config builds (ExportError naming the misfit). A
    drafter export (`what` drafter or both) of a target vLLM serves without EAGLE-3 is refused first,
    before any weights load."""
    cfg_path = ckpt.parent.parent / "config.yaml"
    if not cfg_path.exists():
        raise UserError(f"'{cfg_path}' is missing: the checkpoint's run folder must hold the run's config.yaml")
    cfg = load_config(cfg_path)
    if what != "policy" and (config := target_config(cfg.model)) is not None:
        require_vllm_eagle3(config, "tlt export")
    try:
        tensors, state, _ = load_checkpoint(ckpt)
    except CheckpointError as err:
        raise UserError(f"{err}; pass another checkpoint (runs/<run id>/checkpoints/step-NNNNNN)") from None
    target, tokenizer = load_target(cfg.model)
    _load_strict(target, tensors["policy"], "policy", ckpt)
    drafter = None
    if "drafter" in tensors:
        drafter = build_drafter(target, cfg.drafter)
        _load_strict(drafter, tensors["drafter"], "drafter", ckpt)
    return cfg, target, tokenizer, drafter, state


def heldout_prompts(run_dir: Path) -> list[str]:
    path = run_dir / "heldout.parquet"
    if not path.is_file():
        raise UserError(f"'{path}' is missing: the run folder must hold the held-out split its data stage wrote "
                        "(the export measures its accept lengths on it); pass the checkpoint of a complete run folder")
    return list(pd.read_parquet(path)["prompt"])


def export_checkpoint(ckpt: Path, out: Path, what: str = "both", force: bool = False, run_id: str | None = None,
                      accuracy_at: Callable[[int], float | None] | None = None) -> tuple[Path, object, dict]:
    """Write the checkpoint's model folder at `out`; returns (its path, the run's config, the figures).

    accuracy_at(step): the run's held-out accuracy logged at that step (the run evaluated these
    weights), or None. `--what both` needs the checkpoint's drafter (ExportError without one)."""
    cfg, target, tokenizer, drafter, state = rebuild(ckpt, what)
    if what != "policy" and drafter is None:
        raise ExportError(f"checkpoint '{ckpt}' holds no drafter (the run used rollout.drafter: ngram); export it "
                          "with --what policy")
    run_dir = ckpt.parent.parent
    step = steps_done(state)  # RL steps trained; the run logged their evaluation at this step
    prompts = heldout_prompts(run_dir) if what == "both" else []
    accuracy = accuracy_at(step) if accuracy_at is not None else None
    figures = base_figures(cfg, run_id or run_dir.name, step, accuracy, len(prompts))
    path, figures = write_and_measure(cfg, out, target, tokenizer, eos_token_ids(tokenizer, target), drafter, figures,
                                      prompts, what=what, force=force)
    return path, cfg, figures
