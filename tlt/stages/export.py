"""Stage 6: the run's model folder (tlt.model_folder: policy/ + drafter/ + README.md), its figures
measured on the folder reloaded as a server loads it, logged to MLflow as the run's model and
registered as one version of `export.model_name`; retrain's promotion (tlt.retrain)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tlt import retrain as retraining
from tlt.config import RunConfig
from tlt.model_folder import FORMAT, load_model_folder, provenance, serve_commands, write_model_folder
from tlt.summaries import ExportSummary
from tlt.tracking import set_champion

if TYPE_CHECKING:
    from tlt.build import RunParts


def base_figures(cfg: RunConfig, run_id: str | None, step: int, accuracy: float | None, n: int) -> dict:
    """Provenance and the policy's held-out accuracy (from the run's evaluation of these weights)."""
    s = cfg.drafter.eval_strategy
    return {"base_model": cfg.model.name_or_path, "run_id": run_id or "", "checkpoint_step": step,
            "heldout_accuracy": None if accuracy is None else round(float(accuracy), 4), "heldout_n": n,
            "draft_strategy": s.name, "num_speculative_tokens": s.depth, "precision": cfg.export.dtype,
            "format": FORMAT, **provenance()}


def measure_folder(cfg: RunConfig, folder: Path, prompts: list[str]) -> dict:
    """Held-out accept length, greedy and at the rollout temperature, of the folder's drafter against
    its policy, both reloaded from `folder` in the exported precision (what a server gets), measured
    with tlt's accept-length code (tlt.rollout.acceptance.heldout_accept: tuner off, `drafter.eval_strategy`)."""
    from tlt.build import encoder  # deferred: the engine stack, loaded by the run already
    from tlt.device import resolve_device
    from tlt.models import eos_token_ids
    from tlt.rollout.torch_engine.engine import RolloutEngine
    from tlt.rollout.acceptance import heldout_accept_lens

    model, tokenizer, drafter = load_model_folder(folder, resolve_device(cfg.trainer.device))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    rollout = cfg.rollout.model_copy(update={"dtype": cfg.export.dtype, "tuner": False})
    engine = RolloutEngine(model, rollout, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, drafter=drafter)
    ids = encoder(tokenizer, cfg)(list(prompts[: cfg.drafter.warmstart_eval_prompts]))
    with torch.no_grad():
        greedy, sampled = heldout_accept_lens(engine, ids, cfg)
    return {"accept_len": round(greedy, 4), "accept_len_sampled": round(sampled, 4)}


def tags_of(figures: dict) -> dict[str, str]:
    """A registered version's tags: every figure, as text (a run's and `tlt export`'s versions alike)."""
    return {k: "" if v is None else str(v) for k, v in figures.items()}


def write_and_measure(cfg: RunConfig, out: Path, model, tokenizer, eos_ids, drafter, figures: dict,
                      heldout_prompts: list[str], what: str = "both", force: bool = False) -> tuple[Path, dict]:
    """The model folder at `out`, with the accept lengths measured on it before it is renamed into place."""
    dtype = getattr(torch, cfg.export.dtype)
    has_drafter = what != "policy" and drafter is not None
    measure = (lambda tmp: measure_folder(cfg, tmp, heldout_prompts)) if what == "both" and has_drafter else None
    return write_model_folder(out, model, tokenizer, eos_ids, drafter, dtype, figures, what=what, force=force,
                              measure=measure)


def export(parts: RunParts, accuracy: float | None, heldout_prompts: list[str]) -> ExportSummary:
    """Write, measure, log and register the run's model folder; `accuracy`: the final held-out
    accuracy of these weights (the version's heldout_accuracy tag)."""
    t0 = time.perf_counter()
    cfg, tracker, e = parts.cfg, parts.tracker, parts.cfg.export
    out = Path(e.out_dir) if e.out_dir else parts.run_dir / "model"
    figures = base_figures(cfg, tracker.run_id, cfg.rl.steps, accuracy, len(heldout_prompts))
    what = "both" if parts.drafter is not None else "policy"
    path, figures = write_and_measure(cfg, out, parts.model, parts.tokenizer, parts.eos_ids, parts.drafter, figures,
                                      heldout_prompts, what=what, force=e.out_dir is None)
    version = tracker.log_model(path, "model", register_as=e.model_name if e.register_model else None,
                                tags=tags_of(figures), step=cfg.rl.steps)
    summary = ExportSummary(path=str(path), version=version, accept_len=figures.get("accept_len"),
                            accept_len_sampled=figures.get("accept_len_sampled"), accuracy=accuracy,
                            n=len(heldout_prompts), time_s=time.perf_counter() - t0,
                            serve=(serve_commands(path, figures["num_speculative_tokens"], what) or [""])[0])
    metrics = {"timing_s/export": summary.time_s}
    if summary.accept_len is not None:  # the last step's held-out accept lengths: those of the exported folder
        metrics.update({"eval/accept_len": summary.accept_len, "eval/accept_len_sampled": summary.accept_len_sampled})
    tracker.log_metrics(metrics, step=cfg.rl.steps)
    return summary


def promote(cfg: RunConfig, tracker, exported: ExportSummary, champion: dict | None,
            champion_accuracy: tuple[float, int] | None) -> bool:
    """Move the `champion` alias to the exported version unless the policy's held-out accuracy
    dropped (tlt.retrain.accuracy_dropped) or the drafter's accept length did; the decision and
    its reason are logged (metric export/promoted, tag export.promotion_reason)."""
    ok, reason = retraining.should_promote(exported, champion, champion_accuracy, cfg.deploy)
    if ok:
        set_champion(cfg.export.model_name, exported.version, cfg.tracking.tracking_uri)
    old_acc = champion_accuracy[0] if champion_accuracy else float("nan")
    tracker.log_metrics({"export/promoted": float(ok), "export/champion_accept_len":
                         retraining.champion_accept_len(champion), "export/champion_accuracy": old_acc}, cfg.rl.steps)
    tracker.set_tags({"export.promotion_reason": reason})
    return ok
