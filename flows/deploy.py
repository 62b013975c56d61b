"""Deployments of tlt-train: `manual` (the RunConfig form in the Prefect UI) and `retrain` (cron).

`tlt deploy CONFIG` registers both with the Prefect API; `tlt schedule CONFIG` registers and runs
them in this process (runs are spawned: the console script's `__main__` guard matters).
"""
from __future__ import annotations

from prefect import serve
from prefect.schedules import Cron

from flows.train import tlt_train
from tlt.config import RunConfig


def deployments(cfg: RunConfig, paused_retrain: bool = False) -> list:
    params = {"config": cfg.model_dump(mode="json")}
    manual = tlt_train.to_deployment(
        name="manual", parameters=params, tags=["tlt"],
        description="Train with speculative rollout and an adaptive drafter. Edit the config form, then Run.")
    retrain = tlt_train.to_deployment(
        name="retrain", parameters={**params, "retrain": True}, tags=["tlt", "scheduled"],
        schedule=Cron(cfg.deploy.cron, timezone=cfg.deploy.timezone), paused=paused_retrain,
        description="Scheduled retraining: continue from the registry's champion policy and drafter on the current "
                    "data; promote the new version only if neither held-out accuracy nor accept length dropped.")
    return [manual, retrain]


def apply_deployments(cfg: RunConfig) -> list[str]:
    """Register both deployments with the current Prefect API; returns their ids."""
    return [str(d.apply()) for d in deployments(cfg)]


def serve_deployments(cfg: RunConfig, limit: int | None = None) -> None:
    """Register and run the deployments until interrupted."""
    serve(*deployments(cfg), limit=limit)
