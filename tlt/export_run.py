"""Export the drafter of a finished (or running) training run: by MLflow run id or checkpoint dir."""
from __future__ import annotations

from pathlib import Path

from tlt.arch import require_vllm_eagle3, target_config
from tlt.checkpoint import latest_checkpoint, load_checkpoint
from tlt.config import load_config
from tlt.drafter.model import build_drafter
from tlt.export import export_eagle3
from tlt.models import load_target
from tlt.errors import UserError


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


def export_checkpoint(ckpt: Path, out: Path, force: bool = False) -> tuple[Path, object]:
    """Rebuild target + drafter from the run's config.yaml and the checkpoint; write the EAGLE-3 dir."""
    cfg_path = ckpt.parent.parent / "config.yaml"
    if not cfg_path.exists():
        raise UserError(f"'{cfg_path}' is missing: the checkpoint's run folder must hold the run's config.yaml")
    cfg = load_config(cfg_path)
    if (config := target_config(cfg.model)) is not None:  # before the weights load: vLLM must serve the target
        require_vllm_eagle3(config, "tlt export")
    tensors, _, _ = load_checkpoint(ckpt)
    if "drafter" not in tensors:
        raise UserError(f"checkpoint '{ckpt}' holds no drafter (was the run trained with rollout.drafter: ngram?)")
    target, _ = load_target(cfg.model)
    target.load_state_dict(tensors["policy"], strict=True)
    drafter = build_drafter(target, cfg.drafter)
    drafter.load_state_dict(tensors["drafter"], strict=True)
    return export_eagle3(drafter, target.config, out, force=force), cfg
