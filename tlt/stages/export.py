"""Stage 6: the drafter as an EAGLE-3 directory (tlt.export), logged to MLflow as the run's model,
registered as a version tagged with its held-out accept length; retrain's promotion (tlt.retrain)."""
from __future__ import annotations

import time
from pathlib import Path

from tlt import retrain as retraining
from tlt.config import RunConfig
from tlt.export import export_eagle3
from tlt.summaries import ExportSummary
from tlt.tracking import set_champion


def export(cfg: RunConfig, model, drafter, run_dir: Path, tracker, accept_len: float, accept_len_sampled: float,
           policy_checkpoint: Path | None) -> ExportSummary:
    """Write, log and register the drafter; `accept_len` / `accept_len_sampled`: its held-out accept
    length (greedy, at the rollout temperature) for the version's tags."""
    t0 = time.perf_counter()
    e = cfg.export
    out = Path(e.out_dir) if e.out_dir else run_dir / "drafter_export"
    export_eagle3(drafter, model.config, out, force=e.out_dir is None)
    tags = {"target": cfg.model.name_or_path, "accept_len": f"{accept_len:.3f}",
            "accept_len_sampled": f"{accept_len_sampled:.3f}", "accept_strategy": cfg.drafter.eval_strategy.name,
            "format": "eagle3", "policy_checkpoint": str(policy_checkpoint.resolve()) if policy_checkpoint else ""}
    version = tracker.log_model(out, "drafter", register_as=e.model_name if e.register_model else None,
                                tags=tags, step=cfg.rl.steps)
    summary = ExportSummary(path=str(out), version=version, accept_len=accept_len, time_s=time.perf_counter() - t0)
    tracker.log_metrics({"timing_s/export": summary.time_s}, step=cfg.rl.steps)
    return summary


def promote(cfg: RunConfig, tracker, exported: ExportSummary, champion: dict | None) -> bool:
    """Move the `champion` alias to the exported version unless its held-out accept length is below
    the champion's (`champion`: the version retraining started from; None: the first one); logged."""
    old = retraining.champion_accept_len(champion)
    ok = retraining.should_promote(exported.version, exported.accept_len, champion)
    if ok:
        set_champion(cfg.export.model_name, exported.version, cfg.tracking.tracking_uri)
    tracker.log_metrics({"export/promoted": float(ok), "export/champion_accept_len": old}, cfg.rl.steps)
    return ok
