"""`tlt export`: a run's trained policy and its drafter as one model folder (tlt.model_folder)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tlt import tracking
from tlt.errors import UserError
from tlt.inputs import check_empty_target, resolve_run_id

out, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)


def export(run: Optional[str] = typer.Option(None, "--run", metavar="RUN_ID", help="MLflow run id of a tlt-train run"),
           checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", metavar="DIR", help="A run's checkpoint (or run) folder"),
           out_dir: Path = typer.Option(..., "--out", metavar="DIR", help="Model folder to write: policy/, drafter/, README.md"),
           what: str = typer.Option("both", "--what", metavar="policy|drafter|both", help="policy, drafter or both"),
           force: bool = typer.Option(False, "--force", help="Replace a non-empty --out folder"),
           register: bool = typer.Option(False, "--register", help="Log the folder to the run (--run) and register "
                                         "it as a version of export.model_name")) -> None:
    """Write a run's trained policy and its drafter as one folder that vLLM and SGLang serve."""
    t0 = time.perf_counter()
    root, accuracy_at = "runs", None
    _check_export_args(out_dir, checkpoint, what, force, register, run)
    if run:
        run = resolve_run_id(run, flag="--run")
        if msg := tracking.unsent_warning(run):
            err.print(f"warning: {msg}", markup=False, highlight=False)
        root = tracking.read_run(run)["params"].get("trainer.checkpoint_dir", root)
        history = dict(tracking.metric_histories(run, ["eval/accuracy"])["eval/accuracy"])
        accuracy_at = history.get
    from tlt.export_run import export_checkpoint, resolve_checkpoint  # deferred: torch, transformers
    from tlt.model_folder import serve_commands  # deferred: torch
    from tlt.stages.export import tags_of  # deferred: torch

    ckpt = resolve_checkpoint(run, checkpoint, root)
    path, cfg, figures = export_checkpoint(ckpt, out_dir, what=what, force=force, run_id=run, accuracy_at=accuracy_at)
    out.print(f"exported {ckpt} -> {path} in {time.perf_counter() - t0:.1f} s", highlight=False)
    if register:
        tracker = tracking.make_tracker(cfg.tracking.model_copy(update={"system_metrics": False}), run_id=run)
        version = tracker.log_model(path, "model", register_as=cfg.export.model_name, tags=tags_of(figures),
                                    step=figures["checkpoint_step"])
        tracker.end()
        out.print(f"registered {cfg.export.model_name} version {version}", highlight=False)
    commands = serve_commands(path, figures["num_speculative_tokens"], what)
    out.print("serve it: " + ("\n  or: ".join(commands) if commands else f"(drafter only) see {path / 'README.md'}"),
              markup=False, highlight=False)


def _check_export_args(out_dir: Path, checkpoint: Path | None, what: str, force: bool, register: bool,
                       run: str | None) -> None:
    """`tlt export`'s flags, refused before any model loads."""
    if what not in ("policy", "drafter", "both"):
        raise UserError(f"--what '{what}' is unknown; use policy, drafter or both")
    if register and (run is None or what != "both"):
        raise UserError("--register logs the folder to its training run and registers it as one version holding the "
                        "policy and its drafter: pass --run RUN_ID and --what both (the default)")
    if not force:
        check_empty_target(out_dir, "--out", "pass --force to replace it")
    if checkpoint is not None and not checkpoint.is_dir():
        raise UserError(f"--checkpoint '{checkpoint}' is not a folder; pass a run folder (runs/<run id>) or one of "
                        "its checkpoints (runs/<run id>/checkpoints/step-NNNNNN)")
