"""Scheduled retraining's two decisions: which policy to continue from, and whether to promote
(`should_promote`; tlt.stages.export.promote moves the alias).

The registry's `champion` alias points at a drafter version whose tags carry the policy
checkpoint it was trained with (`policy_checkpoint`) and its held-out accept length
(`accept_len`), both written by the export stage (tlt.stages.export).
"""
from __future__ import annotations

import logging
from pathlib import Path

from safetensors.torch import load_file

from tlt.errors import UserError
from tlt.tracking import champion, download
from tlt.versions import bump

log = logging.getLogger(__name__)

POLICY_FILE = "policy.safetensors"


class RetrainError(UserError):
    """The champion cannot be continued from as configured."""


def champion_policy(champion: dict | None, on_missing: str) -> Path | None:
    """The champion's policy weights file, or None to continue from the base policy.

    None without a champion (the first retrain: nothing to continue from yet). When the champion
    names no checkpoint or its file is gone, raise RetrainError unless `on_missing` is "base"
    (`deploy.on_missing_champion_policy`), which logs a warning and returns None."""
    if champion is None:
        log.warning("retrain: no `champion` alias in the registry yet; starting from the base policy")
        return None
    ckpt = champion.get("tags", {}).get("policy_checkpoint") or ""
    path = Path(ckpt) / POLICY_FILE if ckpt else None
    if path is not None and path.is_file():
        return path
    what = f"'{path}' does not exist" if path else "its model version has no policy_checkpoint tag"
    if on_missing == "base":
        log.warning("retrain: the champion (version %s) policy checkpoint: %s; continuing from the base policy "
                    "as deploy.on_missing_champion_policy=base asks", champion.get("version"), what)
        return None
    raise RetrainError(f"retrain: the champion drafter (version {champion.get('version')}) was trained with a policy "
                       f"checkpoint, but {what}. Restore that checkpoint, move the `champion` alias to a version whose "
                       "checkpoint exists, or set deploy.on_missing_champion_policy=base to continue from the base "
                       "policy.")


def champion_accept_len(champion: dict | None) -> float:
    """The champion's held-out accept length (0 without a champion: anything is promoted)."""
    return float((champion or {}).get("tags", {}).get("accept_len", "0") or 0)


def should_promote(version: str | None, accept_len: float | None, champion: dict | None) -> bool:
    """Promote a registered version unless its accept length dropped below the champion's."""
    return version is not None and (accept_len or 0.0) >= champion_accept_len(champion)


# ---------------------------------------------------------------- the retrain stages
def load_champion_policy(model, cfg, tracker) -> dict | None:
    """Retrain: load into `model` the policy checkpoint the champion drafter was trained with
    (`champion_policy` decides; a missing one is an error unless the config allows the base).
    Tags the run with where it continued from; returns the champion (None without one)."""
    found = champion(cfg.export.model_name, cfg.tracking.tracking_uri)
    path = champion_policy(found, cfg.deploy.on_missing_champion_policy)
    if path is not None:
        model.load_state_dict(load_file(path), strict=True)
        bump(model)
    tracker.set_tags({"retrain.from_version": (found or {}).get("version", "none"),
                      "retrain.policy": str(path.parent) if path is not None else "base"})
    return found


def load_champion_drafter(drafter, found: dict, cfg, dst: Path) -> Path:
    """Retrain: the champion's exported drafter weights into `drafter` (no warm-start); returns
    the local copy of its directory."""
    local = download(found["source"], dst, cfg.tracking.tracking_uri)
    drafter.load_state_dict(load_file(local / "model.safetensors"), strict=True)
    bump(drafter)
    return local

