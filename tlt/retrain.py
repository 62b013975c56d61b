"""Scheduled retraining's two decisions: what to continue from, and whether to promote.

The registry's `champion` alias points at a version of `export.model_name`. A version in the
model-folder format (tag `format: tlt-model`, written by tlt.stages.export) holds the files
themselves: retraining downloads them (the version's artifact URI, so it works after `rm -rf
runs/`, on another machine, against a remote tracking server) and continues from its `policy/`
and `drafter/`. A version of the older drafter-only format (an EAGLE-3 folder plus a
`policy_checkpoint` tag naming a local checkpoint) is still continued from while that checkpoint
exists; otherwise the run stops with exit 2 (or `deploy.on_missing_champion_policy: base`).

Promotion (`should_promote`) judges the model: the policy's held-out accuracy must not have
dropped (`accuracy_dropped`: a one-sided two-proportion test) and the drafter's held-out accept
length must not be below the champion's.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from statistics import NormalDist

from safetensors.torch import load_file

from tlt.errors import UserError
from tlt.model_folder import DRAFTER, FORMAT, POLICY, load_policy_weights
from tlt.tracking import champion, download
from tlt.versions import write_weights

log = logging.getLogger(__name__)

POLICY_FILE = "policy.safetensors"
LEGACY_NAME = "tlt-drafter"  # export.model_name before the model folder (drafter-only versions)


class RetrainError(UserError):
    """The champion cannot be continued from as configured."""


def is_model_folder(found: dict | None) -> bool:
    return bool(found) and found.get("tags", {}).get("format") == FORMAT


def champion_policy(champion: dict | None, on_missing: str) -> Path | None:
    """An old-format champion's policy checkpoint file, or None to continue from the base policy.

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
    raise RetrainError(f"retrain: the champion (version {champion.get('version')}) is a drafter-only version of the "
                       f"older format, whose policy lives in a local checkpoint, but {what}. Restore that "
                       "checkpoint, or register a model folder of that run (`tlt export --run RUN_ID --out DIR "
                       "--register`, then move the `champion` alias to the new version), or set "
                       "deploy.on_missing_champion_policy=base to continue from the base policy.")


def _find_champion(cfg) -> dict | None:
    found = champion(cfg.export.model_name, cfg.tracking.tracking_uri)
    if found is None and cfg.export.model_name != LEGACY_NAME and champion(LEGACY_NAME, cfg.tracking.tracking_uri):
        log.warning("retrain: no `champion` of '%s', but '%s' (the older drafter-only registry) has one; set "
                    "export.model_name: %s to continue from it", cfg.export.model_name, LEGACY_NAME, LEGACY_NAME)
    return found


def load_champion_policy(model, cfg, tracker, dst: Path) -> dict | None:
    """Retrain: load the champion's policy into `model`: a model-folder version's files are
    downloaded into `dst` (kept under found["local"] for the drafter), an old one's checkpoint
    is read where its tag says. Tags the run with where it continued from; returns the champion
    (None without one), with found["policy_loaded"] telling whether its policy was loaded."""
    found = _find_champion(cfg)
    where = "base"
    if is_model_folder(found):
        local = download(found["source"], dst, cfg.tracking.tracking_uri)
        if not (local / POLICY).is_dir() or not (local / DRAFTER).is_dir():
            raise RetrainError(f"retrain: the champion (version {found['version']}) of '{cfg.export.model_name}' "
                               f"lacks {POLICY}/ or {DRAFTER}/ (downloaded to {local}); move the `champion` alias "
                               "to a version exported with --what both")
        load_policy_weights(model, local / POLICY)
        found.update(local=str(local), policy_loaded=True)
        where = f"{found['source']} ({POLICY}/)"
    else:
        path = champion_policy(found, cfg.deploy.on_missing_champion_policy)
        if path is not None:
            write_weights(model, load_file(path))
            where = str(path.parent)
        if found is not None:
            found["policy_loaded"] = path is not None
    tracker.set_tags({"retrain.from_version": (found or {}).get("version", "none"), "retrain.policy": where})
    return found


def load_champion_drafter(drafter, found: dict, cfg, dst: Path) -> Path:
    """Retrain: the champion's exported drafter weights into `drafter` (no warm-start); returns
    the local copy of its EAGLE-3 directory."""
    local = Path(found["local"]) / DRAFTER if found.get("local") else download(found["source"], dst,
                                                                                cfg.tracking.tracking_uri)
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(local / "model.safetensors").items()}
    state.setdefault("d2t", drafter.d2t)  # a full-vocabulary export ships no maps (identity)
    state.setdefault("t2d", drafter.t2d)
    try:
        write_weights(drafter, state)
    except RuntimeError as err:
        raise RetrainError(f"retrain: the champion's drafter (version {found.get('version')}) does not fit this run's "
                           f"drafter ({str(err).splitlines()[0]}); set drafter.draft_vocab_size and "
                           "drafter.aux_layer_ids as the champion's run had them, or move the alias") from None
    return local


# ---------------------------------------------------------------- promotion
def champion_accept_len(champion: dict | None) -> float:
    """The champion's held-out accept length (0 without a champion: anything is promoted)."""
    return float((champion or {}).get("tags", {}).get("accept_len", "0") or 0)


def champion_accuracy(champion: dict | None, evals: list[tuple[int, float]], n: int) -> tuple[float, int] | None:
    """(accuracy, prompts) of the champion's policy: measured at step 0 of this retrain (same
    held-out prompts, same decoding) when the retrain continued from its policy, else its version's
    heldout_accuracy tag at its heldout_n; None when neither exists (an old-format champion)."""
    if champion is None:
        return None
    step0 = [acc for step, acc in evals if step == 0]
    if champion.get("policy_loaded") and step0:
        return step0[-1], n
    tags = champion.get("tags", {})
    if tags.get("heldout_accuracy") and tags.get("heldout_n"):
        return float(tags["heldout_accuracy"]), int(tags["heldout_n"])
    return None


def accuracy_dropped(old: float, n_old: int, new: float, n_new: int, alpha: float,
                     tolerance: float = 0.0) -> tuple[bool, float]:
    """(dropped, z): one-sided two-proportion z-test (pooled variance) of "the new accuracy is
    lower than the old one minus `tolerance`" at significance `alpha`. At 32 held-out prompts and
    accuracy ~0.3 a drop must exceed ~0.19 to count, at 500 prompts ~0.05: noise of a small held-out
    set does not block a promotion, a real regression does."""
    pooled = (old * n_old + new * n_new) / max(n_old + n_new, 1)
    se = math.sqrt(pooled * (1 - pooled) * (1 / max(n_old, 1) + 1 / max(n_new, 1)))
    diff = new - old + tolerance
    if se == 0:
        return diff < 0, -math.inf if diff < 0 else 0.0
    z = diff / se
    return z < -NormalDist().inv_cdf(1 - alpha), z


def should_promote(exported, champion: dict | None, old_accuracy: tuple[float, int] | None,
                   deploy) -> tuple[bool, str]:
    """(promote, reason) for an exported version (an ExportSummary) against the champion: refused
    when it has no version, when its policy's held-out accuracy dropped (`accuracy_dropped` with
    deploy.promote_accuracy_alpha / promote_accuracy_tolerance) or its drafter's accept length is
    below the champion's."""
    if exported.version is None:
        return False, "no registered version (export.register_model is off, or the store was unreachable)"
    if champion is None:
        return True, "first version: the registry has no champion yet"
    reasons = []
    if old_accuracy is not None and exported.accuracy is not None:
        (old, n_old), new = old_accuracy, exported.accuracy
        dropped, z = accuracy_dropped(old, n_old, new, exported.n, deploy.promote_accuracy_alpha,
                                      deploy.promote_accuracy_tolerance)
        verdict = "dropped" if dropped else "held"
        reasons.append((dropped, f"held-out accuracy {verdict}: {new:.3f} on {exported.n} prompts vs the champion's "
                                 f"{old:.3f} on {n_old} (one-sided z = {z:.2f}, alpha {deploy.promote_accuracy_alpha:g}, "
                                 f"tolerance {deploy.promote_accuracy_tolerance:g})"))
    else:
        reasons.append((False, "held-out accuracy not compared (the champion has no accuracy figure)"))
    old_len, new_len = champion_accept_len(champion), exported.accept_len or 0.0
    reasons.append((new_len < old_len, f"accept length {'dropped' if new_len < old_len else 'held'}: {new_len:.3f} vs "
                                       f"the champion's {old_len:.3f}"))
    refused = [text for bad, text in reasons if bad]
    return not refused, "; ".join(refused or [text for _, text in reasons])

