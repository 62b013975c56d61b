"""What every bench/ suite shares (docs/performance.md: Benchmark suites): the command line, runs and
their arms interleaved step by step, the A/B timer, the statistics and the results writer.
bench/ is a folder of scripts, not a package: `load(name)` imports a sibling script as a module.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from tlt.config import load_config

ROOT = Path(__file__).resolve().parents[1]
HEADER = ("command", "commit", "machine", "date", "config_hash")
ALPHA = 0.01
PARITY_TEST = ("paired sign-flip permutation test (two-sided, 20000 draws, seed 0) on the mean over (step, prompt) "
               "pairs of the difference of group-mean rewards, {b} - {a} (same prompts per step), alpha 0.01")
STEP_METRICS = {  # step record key -> the RL step's metric
    "step_s": "timing_s/step", "rollout_s": "timing_s/rollout", "update_policy_s": "timing_s/update_policy",
    "update_drafter_s": "timing_s/update_drafter", "sync_s": "timing_s/sync", "reward_mean": "reward/mean",
    "accept_len": "spec/accept_len/mean", "spec_enabled_share": "spec/enabled_share", "ngram_share": "spec/ngram_share",
    "tail_share": "rollout/tail_share", "response_length_mean": "rollout/response_length/mean",
    "tokens_per_target_forward": "rollout/tokens_per_target_forward", "drafter_spot_steps": "drafter/spot_steps",
    "drafter_steps_total": "drafter/steps", "drafter_loss": "drafter/loss", "buffer_tokens": "drafter/buffer_tokens",
    "rebuilds": "rollout/vllm_rebuilds", "guard_tripped": "spec/guard_tripped", "regret": "spec/regret"}
if str(ROOT / "bench") not in sys.path:  # the suites import this module and each other by name
    sys.path.insert(0, str(ROOT / "bench"))


def load(name: str):
    """bench/<name>.py as a module named bench_<name> (cached in sys.modules)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "bench" / f"{name}.py")
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


# ---------------------------------------------------------------- command line
def parser(doc: str, *flags: tuple, steps: int | None = None, out_dir: bool = False, config: str | None = None,
           threads: bool = False) -> argparse.ArgumentParser:
    """CONFIG (optional with a default `config`), --json, --set (repeatable); --steps, --out-dir, --threads on
    request; then each of `flags`: (flag, default, help[, type or tuple of choices]), a False default a switch."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("config", **({"nargs": "?", "default": config} if config else {}))
    ap.add_argument("--json", dest="json_out", help="write the result (with its provenance header) here")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    common = [("--steps", steps, f"RL steps per arm (default {steps})")] if steps is not None else []
    common += [("--out-dir", None, "run folders (default: a temporary folder, removed)")] if out_dir else []
    common += [("--threads", None, "torch intra-op threads (default: torch's)", int)] if threads else []
    for flag, default, text, *kind in [*common, *flags]:
        if default is False:
            ap.add_argument(flag, action="store_true", help=text)
            continue
        choices = kind[0] if kind and isinstance(kind[0], tuple) else None
        typ = kind[0] if kind and choices is None else type(default) if default is not None else str
        ap.add_argument(flag, type=typ, default=default, choices=choices, help=text)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments; --threads applied."""
    args = ap.parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return args


def config(args, *extra: str, base: tuple = ()):
    """The RunConfig of args.config with the overrides `base`, args.overrides, `extra` (the last wins)."""
    return load_config(args.config, [*base, *args.overrides, *extra])


def heldout_prompts(cfg, tokenizer, n: int | None = None) -> list[list[int]]:
    """The config's held-out prompts rendered as the pipeline renders them: all, or n (cycling)."""
    from tlt.build import encoder
    from tlt.prompts import load_dataset

    held = load_dataset(cfg.data, tokenizer).heldout["prompt"].tolist()
    return encoder(tokenizer, cfg)([held[i % len(held)] for i in range(n or len(held))])


# ---------------------------------------------------------------- runs
def run_overrides(out_dir: Path, steps: int | None = None, name: str | None = None) -> list[str]:
    """What every benchmark run sets: checkpoints in `out_dir` and none inside the steps, no sample
    tables; rl.steps = steps + 1 so the pipeline's final checkpoint is never written."""
    sets = [f"trainer.checkpoint_dir={out_dir}", f"trainer.checkpoint_every={10 ** 6}", "tracking.samples_every=0"]
    sets += [f"rl.steps={steps + 1}"] if steps is not None else []
    return sets + ([f"name={name}"] if name else [])


@contextmanager
def workdir(path: str | None, prefix: str):
    """`path` (kept), or a temporary folder removed at the end."""
    if path is None:
        with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as tmp:
            yield Path(tmp)
    else:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)


@contextmanager
def pipelines(cfgs: dict):
    """One `Pipeline` per arm, data validated and models loaded; all closed at the end."""
    from tlt.pipeline import Pipeline

    with ExitStack() as stack:
        pipes = {}
        for arm, cfg in cfgs.items():
            pipes[arm] = stack.enter_context(Pipeline(cfg))
            pipes[arm].validate_data()
            pipes[arm].prepare()
        yield pipes


def rotated(order: list, i: int) -> list:
    """`order` rotated by i: who goes first changes every step."""
    k = i % len(order)
    return list(order[k:]) + list(order[:k])


def run_steps(pipes: dict, steps: int, on_step=None) -> dict[str, list[dict]]:
    """RL steps 0..steps-1 of every arm, interleaved (the order rotating every step); per arm and step a record
    (STEP_METRICS, per-sample rewards by group), a line printed and `on_step(arm, pipe, record)` called."""
    records: dict[str, list[dict]] = {arm: [] for arm in pipes}
    zero = {"rollout_s", "update_policy_s", "update_drafter_s", "sync_s", "spec_enabled_share", "ngram_share"}
    for step in range(steps):
        for arm in rotated(list(pipes), step):
            s = pipes[arm].rl_step(step)
            m, ids = s.metrics, list(dict.fromkeys(x["prompt_id"] for x in s.samples))
            records[arm].append({**{k: m.get(key, 0.0 if k in zero else None) for k, key in STEP_METRICS.items()},
                                 "drafter_train_s": m.get("drafter/train_s", m.get("drafter/idle_time_used_s", 0.0)),
                                 "rewards": [float(x["reward"]) for x in s.samples],
                                 "group_index": [ids.index(x["prompt_id"]) for x in s.samples],
                                 "prompts": list(dict.fromkeys(x["prompt"] for x in s.samples))})
            print(f"step {step} {arm:>11}: {s.step_s:7.1f} s, reward {s.reward_mean:.3f}, "
                  f"accept {s.accept_len or 0:.2f}", flush=True)
            if on_step is not None:
                on_step(arm, pipes[arm], records[arm][-1])
    return records


# ---------------------------------------------------------------- timing and statistics
def timed(fn):
    """(fn(), seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def best_of(arms: dict, reps: int) -> dict:
    """The A/B timer: the arms (name -> callable) once per rep, interleaved; name -> (best seconds, its output)."""
    best: dict = {}
    for _ in range(reps):
        for name, fn in arms.items():
            out, dt = timed(fn)
            if dt < best.get(name, (float("inf"),))[0]:
                best[name] = (dt, out)
    return best


def mean_excluding_first(values: list[float]) -> float:
    """Mean over steps 1..N-1 (step 0 pays one-off costs); the only value when N = 1."""
    return float(np.mean(values[1:] if len(values) > 1 else values))


def sign_flip_p(diffs, n_perm: int = 20_000) -> float:
    """Two-sided paired sign-flip permutation test of mean(diffs) = 0 (seed 0): the p-value."""
    diffs = np.asarray(diffs, float)
    obs = abs(diffs.mean())
    null = np.abs((np.random.default_rng(0).choice([-1.0, 1.0], size=(n_perm, len(diffs))) * diffs).mean(axis=1))
    return float((1 + np.sum(null >= obs - 1e-12)) / (n_perm + 1))


def group_means(rewards: list[float], group_index: list[int]) -> np.ndarray:
    r, g = np.asarray(rewards, float), np.asarray(group_index)
    return np.array([r[g == k].mean() for k in sorted(set(group_index))])


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided Welch t-test p-value; 1.0 when both samples are constant and equal."""
    if np.std(a) == 0 and np.std(b) == 0:
        return 1.0 if np.mean(a) == np.mean(b) else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def parity(base: list[dict], other: list[dict], names: tuple[str, str] = ("plain", "adaptive")) -> dict:
    """Do two runs' reward curves match (step records, same prompts per step)? `PARITY_TEST`, match =
    p >= ALPHA; per-step Welch t-tests on the per-sample rewards for information (Bonferroni)."""
    diffs = np.concatenate([group_means(o["rewards"], o["group_index"]) - group_means(b["rewards"], b["group_index"])
                            for b, o in zip(base, other)])
    p_value = sign_flip_p(diffs)
    welch = [welch_p(b["rewards"], o["rewards"]) for b, o in zip(base, other)]
    return {"parity_test": PARITY_TEST.format(a=names[0], b=names[1]), "parity_p_value": p_value,
            "parity_n_pairs": int(len(diffs)), "parity_mean_diff": float(diffs.mean()),
            "reward_curves_match": bool(p_value >= ALPHA), "welch_p_per_step": welch,
            "welch_all_steps_match": bool(all(w >= ALPHA / len(welch) for w in welch))}


def print_keys(res: dict, keys=None) -> None:
    """One aligned `key: value` line per key (default: every number, flag, None and short string)."""
    short = (int, float, type(None))
    keys = keys or [k for k, v in res.items() if isinstance(v, short) or isinstance(v, str) and len(v) < 60]
    for k in (k for k in keys if k in res):
        print(f"{k:>30}: {res[k]:.3f}" if isinstance(res[k], float) else f"{k:>30}: {res[k]}")


# ---------------------------------------------------------------- provenance and results
def config_hash(config: str | None, overrides: list[str]) -> str | None:
    """First 12 hex digits of the sha256 of the resolved config (recipe + overrides, defaults filled in)."""
    if config is None:
        return None
    return hashlib.sha256(load_config(config, overrides).model_dump_json().encode()).hexdigest()[:12]


def write_result(res: dict, script: str, args, argv: list[str] | None, show=None) -> dict:
    """The result printed (print_keys' `show`) and returned with its provenance header first (command
    line, commit, machine, date, config hash); written to `args.json_out` when given."""
    print_keys(res, show)
    argv = list(sys.argv[1:] if argv is None else argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    info = Path("/proc/cpuinfo")  # the machine: CPU model and cores, the GPU's name when there is one; no host names
    lines = info.read_text().splitlines() if info.exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())
    gpu = f", {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if torch.cuda.is_available() else ""
    out = {"command": " ".join([f"python bench/{script}.py", *argv]), "commit": commit.strip(),
           "machine": f"{cpu}, {os.cpu_count()} cores{gpu}", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "config_hash": config_hash(getattr(args, "config", None), getattr(args, "overrides", [])), **res}
    if getattr(args, "json_out", None):
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    return out
