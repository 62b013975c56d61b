"""The benchmark harness every bench/ suite shares.

- `parser`: the common command line (CONFIG, `--set key=value`, `--json OUT`, `--steps N`, `--out-dir`);
- `run_overrides`, `pipelines`, `workdir`: building and closing benchmark runs (`Pipeline`s whose
  checkpoints go to a scratch folder and whose final checkpoint is never written);
- `interleave`, `rotated`, `best_of`, `timed`: arms interleaved step by step with the order rotating,
  so a shared machine's noise hits every arm alike, and the A/B timer (best of reps);
- `write_result`: the results writer; every JSON starts with its provenance (command line, git
  commit, machine, date, hash of the resolved config), which `bench/render.py` shows next to each
  number.

bench/ is a folder of scripts, not a package: `load(name)` imports a sibling script as a module.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HEADER = ("command", "commit", "machine", "date", "config_hash")
NO_CHECKPOINTS = 10 ** 6  # trainer.checkpoint_every of benchmark runs: never inside the timed steps


def load(name: str):
    """bench/<name>.py as a module named bench_<name> (cached in sys.modules)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


# ---------------------------------------------------------------- command line
def parser(doc: str, steps: int | None = None, out_dir: bool = False,
           config: str | None = None) -> argparse.ArgumentParser:
    """CONFIG (optional when `config` names a default), --json, --set (repeatable); --steps when the
    suite runs RL steps; --out-dir when it keeps run folders (default: a temporary folder, removed).
    Benchmarks run offline (HF_HUB_OFFLINE)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("config", **({"nargs": "?", "default": config} if config else {}))
    ap.add_argument("--json", dest="json_out", help="write the result (with its provenance header) here")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    if steps is not None:
        ap.add_argument("--steps", type=int, default=steps, help=f"RL steps per arm (default {steps})")
    if out_dir:
        ap.add_argument("--out-dir", default=None, help="run folders (default: a temporary folder, removed)")
    return ap


# ---------------------------------------------------------------- runs
def run_overrides(out_dir: Path, steps: int | None = None, name: str | None = None) -> list[str]:
    """What every benchmark run sets: checkpoints in `out_dir` and none inside the steps, no sample
    tables; rl.steps = steps + 1 so the pipeline's final checkpoint is never written."""
    sets = [f"trainer.checkpoint_dir={out_dir}", f"trainer.checkpoint_every={NO_CHECKPOINTS}",
            "tracking.samples_every=0"]
    sets += [f"rl.steps={steps + 1}"] if steps is not None else []
    return sets + ([f"name={name}"] if name else [])


@contextmanager
def workdir(path: str | None, prefix: str):
    """`path` (kept), or a temporary folder removed at the end."""
    out = Path(path or tempfile.mkdtemp(prefix=prefix))
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    finally:
        if path is None:
            shutil.rmtree(out, ignore_errors=True)


@contextmanager
def pipelines(cfgs: dict, prepare: bool = True):
    """One `Pipeline` per arm (data validated and models loaded with `prepare`); all closed at the end."""
    from tlt.pipeline import Pipeline

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pipes: dict = {}
    try:
        for arm, cfg in cfgs.items():
            pipes[arm] = Pipeline(cfg)
            if prepare:
                pipes[arm].validate_data()
                pipes[arm].prepare()
        yield pipes
    finally:
        for p in pipes.values():
            p.close()


# ---------------------------------------------------------------- arms and timing
def rotated(order: list, i: int) -> list:
    """`order` rotated by i: who goes first changes every step."""
    k = i % len(order)
    return list(order[k:]) + list(order[:k])


def interleave(pipes: dict, steps: int, on_step) -> None:
    """RL steps 0..steps-1 of every arm, interleaved step by step with the order rotating;
    `on_step(arm, step, summary)` after each."""
    for step in range(steps):
        for arm in rotated(list(pipes), step):
            on_step(arm, step, pipes[arm].rl_step(step))


def timed(fn):
    """(fn(), seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def best_of(arms: dict, reps: int, warmup: int = 0) -> dict:
    """The A/B timer: every arm (name -> zero-argument callable) run `warmup` times untimed (first
    touches, caches), then once per rep, interleaved in the given order; name -> (best seconds,
    output of the last run)."""
    for _ in range(warmup):
        for fn in arms.values():
            fn()
    best: dict = {}
    for _ in range(reps):
        for name, fn in arms.items():
            out, dt = timed(fn)
            best[name] = (min(dt, best.get(name, (float("inf"),))[0]), out)
    return best


def sign_flip_p(diffs, n_perm: int = 20_000) -> float:
    """Two-sided paired sign-flip permutation test of mean(diffs) = 0 (seed 0): the p-value."""
    diffs = np.asarray(diffs, float)
    obs = abs(diffs.mean())
    null = np.abs((np.random.default_rng(0).choice([-1.0, 1.0], size=(n_perm, len(diffs))) * diffs).mean(axis=1))
    return float((1 + np.sum(null >= obs - 1e-12)) / (n_perm + 1))


def mean_excluding_first(values: list[float]) -> float:
    """Mean over steps 1..N-1 (step 0 pays one-off costs); the only value when N = 1."""
    return float(np.mean(values[1:] if len(values) > 1 else values))


def print_table(rows: list[dict], columns: dict) -> None:
    """`rows` as an aligned text table; columns: key -> (title, format spec), e.g. {"step_s": ("step s", ".1f")}."""
    cells = [[title for title, _ in columns.values()]]
    cells += [["–" if r.get(k) is None else format(r[k], f) for k, (_, f) in columns.items()] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for c in cells:
        print(" ".join(v.rjust(w) for v, w in zip(c, widths)))


# ---------------------------------------------------------------- provenance and results
def machine() -> str:
    """CPU model and core count (and the GPU's name when there is one); no host names or paths."""
    cpu = platform.processor()
    info = Path("/proc/cpuinfo")
    if info.exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} cores{gpu}"


def config_hash(config: str | None, overrides: list[str]) -> str | None:
    """First 12 hex digits of the sha256 of the resolved config (recipe + overrides, defaults filled in)."""
    if config is None:
        return None
    from tlt.config import load_config

    return hashlib.sha256(load_config(config, overrides).model_dump_json().encode()).hexdigest()[:12]


def provenance(script: str, argv: list[str], config: str | None, overrides: list[str]) -> dict:
    """Where a result comes from: the command line, commit, machine, date and config hash."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return {"command": " ".join([f"python bench/{script}.py", *argv]), "commit": commit.strip(),
            "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config_hash": config_hash(config, overrides)}


def write_result(res: dict, script: str, args, argv: list[str] | None) -> dict:
    """The result with its provenance header first; written to `args.json_out` when given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out = {**provenance(script, argv, getattr(args, "config", None), getattr(args, "overrides", [])), **res}
    if getattr(args, "json_out", None):
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
    return out
