"""Atomic, verified run checkpoints.

Layout of one checkpoint (`root/step-000007/`):

    policy.safetensors, drafter.safetensors, ...   one file per tensor group (safetensors only)
    <blob>.pt                                      optimizer states etc. (torch.save; load with
                                                   torch.load(weights_only=True), see `load_pt`)
    state.json                                     step, data cursor, RNG states, tuner state, ...
    MANIFEST.json                                  sha256 + size of every other file; written last

Everything is written into a temp dir in the same folder (`.tmp-step-000007-<pid>-<rand>`),
fsynced, and renamed in one `os.replace`; a checkpoint without a verifying manifest is never
returned by `latest_checkpoint`, so a crash at any point leaves the previous one usable.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tlt.atomic import fsync_dir, staged_dir, write_file
from tlt.device import to_cpu

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
STATE = "state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or fails verification."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------- writing

def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_name(name: str, what: str) -> None:
    if not _NAME.match(name):
        raise CheckpointError(f"{what} name '{name}' must be letters, digits, '_', '.', '-' (no path separators)")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors with no two sharing storage (safetensors refuses shared
    storage: tied embeddings, or ZeRO's flat buffers that every parameter views into)."""
    out, seen = {}, set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        whole = t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
        if storage.data_ptr() in seen or not whole:
            t = t.clone()
        seen.add(storage.data_ptr())
        out[key] = t
    return out


def _write_files(tmp: Path, step: int, tensors: dict, state: dict, blobs: dict) -> None:
    for name, group in tensors.items():
        _check_name(name, "tensor group")
        save_file(_unshared(group), str(tmp / f"{name}.safetensors"), metadata={"format": "pt"})
    for name, write in blobs.items():
        _check_name(name, "blob")
        write(tmp / f"{name}.pt")
    (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=1, sort_keys=True))
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    for p in files:
        _fsync_file(p)
    manifest = {"step": step, "files": {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_file(tmp / MANIFEST)
    fsync_dir(tmp)


def save_checkpoint(root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict,
                    blobs: dict[str, Callable[[Path], None]] | None = None, keep: int | None = None) -> Path:
    """Write `root/step-{step:06d}/` atomically and return its path.

    tensors: group name -> state dict, each saved as `<group>.safetensors` (pass only what must
      be restored: e.g. the drafter's trainable weights).
    state: JSON-serialisable dict (step is added); put `capture_rng()` under a key of it.
    blobs: name -> writer called with the path `<tmp>/<name>.pt` (e.g. `torch_blob(opt.state_dict())`).
    keep: keep only the newest `keep` checkpoints (None = keep all).
    An existing checkpoint of the same step is replaced.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root)
    final = root / step_dir_name(step)
    with staged_dir(final, prefix=_TMP_PREFIX) as tmp:  # re-saving a step replaces it in one rename
        _write_files(tmp, step, tensors, state, blobs or {})
    if keep is not None:
        prune_checkpoints(root, keep)
    return final


def torch_blob(obj: Any) -> Callable[[Path], None]:
    """A blob writer that `torch.save`s `obj` (tensors, numbers, strings, containers only), its
    tensors copied to the CPU now (an optimizer state on a GPU loads on any machine)."""
    obj = to_cpu(obj)
    return lambda path: torch.save(obj, path)


def _remove_stale_tmp(root: Path) -> None:
    """Temp dirs left by crashed *other* processes (ours may be in flight in another thread)."""
    for p in root.glob(f"{_TMP_PREFIX}*"):
        if p.is_dir() and f"-{os.getpid()}-" not in p.name:
            log.warning("removing leftover temp checkpoint dir %s", p)
            shutil.rmtree(p, ignore_errors=True)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Completed checkpoint dirs, oldest first (temp dirs never match the name pattern)."""
    found = []
    for p in Path(root).iterdir() if Path(root).is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; returns the deleted paths."""
    if keep < 1:
        raise ValueError("prune_checkpoints: keep must be >= 1")
    doomed = [p for _, p in _step_dirs(root)[:-keep]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def drop_blobs(root: Path, names: set[str], keep: int) -> list[Path]:
    """Remove the blobs `names` (e.g. an optimizer state: only a resume reads it, and a resume
    starts from the newest checkpoint) from all but the newest `keep` checkpoints; returns the
    files removed. The manifest is rewritten first (atomically), so a crash in between leaves an
    unlisted file, never a checkpoint that fails verification."""
    if keep < 1:
        raise ValueError("drop_blobs: keep must be >= 1")
    removed = []
    for _, path in _step_dirs(root)[:-keep]:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            continue  # not verifiable anyway; newest_verified skips it
        gone = [n for n in manifest.get("files", {}) if n.endswith(".pt") and n[:-len(".pt")] in names]
        if not gone:
            continue
        for n in gone:
            del manifest["files"][n]
        text = json.dumps(manifest, indent=1, sort_keys=True)
        write_file(path / MANIFEST, lambda tmp: tmp.write_text(text))
        for n in gone:
            (path / n).unlink(missing_ok=True)
            removed.append(path / n)
    return removed


# ---------------------------------------------------------------- reading

def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file in the manifest exists with its sha256."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: no readable {MANIFEST} ({err})") from None
    if STATE not in files:
        raise CheckpointError(f"{path}: {STATE} missing from the manifest")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its sha256 (corrupt or modified)")


def newest_verified(root: Path) -> tuple[Path | None, list[Path]]:
    """(the newest checkpoint under `root` that verifies, the newer ones skipped as corrupt).

    Each skipped checkpoint gets a warning in the log; callers turn the count into a metric."""
    root = Path(root)
    if not root.is_dir():
        return None, []
    for p in root.glob(f"{_TMP_PREFIX}*"):
        log.warning("ignoring incomplete checkpoint %s (temp dir of an interrupted save)", p)
    skipped = []
    for _, path in reversed(_step_dirs(root)):
        try:
            verify_checkpoint(path)
            return path, skipped
        except CheckpointError as err:
            log.warning("skipping corrupt checkpoint, using an older one: %s", err)
            skipped.append(path)
    return None, skipped


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under `root` that verifies; corrupt ones are skipped with a warning."""
    return newest_verified(root)[0]


def load_checkpoint(path: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict, dict[str, Path]]:
    """Verify and read a checkpoint -> (tensor groups, state, blob name -> .pt path)."""
    path = Path(path)
    verify_checkpoint(path)
    files = json.loads((path / MANIFEST).read_text())["files"]
    tensors = {n[:-len(".safetensors")]: load_file(str(path / n)) for n in files if n.endswith(".safetensors")}
    pt_paths = {n[:-len(".pt")]: path / n for n in files if n.endswith(".pt")}
    state = json.loads((path / STATE).read_text())
    return tensors, state, pt_paths


def load_pt(path: Path) -> Any:
    """torch.load restricted to tensors and plain containers (no code runs from the file)."""
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------- RNG

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng() -> dict:
    """JSON-serialisable RNG states of python `random`, numpy's global RNG, torch CPU (+ CUDA)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(internal), gauss],
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
           "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(d: dict) -> None:
    """Inverse of `capture_rng` (CUDA states restored when present and a GPU is available)."""
    version, internal, gauss = d["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = d["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(d["torch"]))
    if "cuda" in d and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in d["cuda"]])
