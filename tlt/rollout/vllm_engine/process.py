"""The vLLM worker process seen from tlt's side: which Python runs it (the `.venv-vllm` build, or
$TLT_VLLM_PYTHON), where its weight folders live (/dev/shm when it has room), how it is stopped
(its whole process group, its folder removed) and the KV cache budget it is given."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from tlt.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("vllm_worker.py")
PYTHON_ENV = "TLT_VLLM_PYTHON"  # another interpreter with vllm installed (default: .venv-vllm)


class VllmUnavailable(UserError):
    """No vLLM interpreter: the message says how to build one."""


class VllmWorkerError(RuntimeError):
    """The vLLM worker failed a request or died; the message holds its error and log tail."""


def vllm_python(python: str | Path | None = None) -> Path:
    """The interpreter that runs the worker: argument, $TLT_VLLM_PYTHON, or .venv-vllm/bin/python."""
    given = python or os.environ.get(PYTHON_ENV)
    candidates = [Path(given)] if given else [Path.cwd() / ".venv-vllm/bin/python", ROOT / ".venv-vllm/bin/python"]
    for path in candidates:
        if path.exists():
            return path
    raise VllmUnavailable(
        f"rollout.backend is 'vllm' but there is no vLLM interpreter at {candidates[0]}. Build the vLLM "
        f"venv with `bash bench/vllm_venv.sh` (~3 min, 3.5 GB), point {PYTHON_ENV} at a python that has "
        "vllm installed, or set rollout.backend=torch.")


def work_root(run_dir: Path, need_bytes: int) -> Path:
    """A fresh folder for weights: under /dev/shm when it has room for them, else under the run dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need_bytes:
        return Path(tempfile.mkdtemp(prefix="tlt-vllm-", dir=shm))
    (run_dir / "vllm").mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="weights-", dir=run_dir / "vllm"))


def shutdown_worker(proc: subprocess.Popen, work: Path, timeout: float = 60.0) -> None:
    """Ask the worker to exit, then end its whole process group (vLLM's engine core included)."""
    if proc.poll() is None:
        try:
            proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            proc.stdin.flush()
            proc.wait(timeout)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # the worker leads its own session: only its processes
        except ProcessLookupError:
            break
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            continue
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()
    shutil.rmtree(work, ignore_errors=True)


def kv_cache_budget_mib(config, dtype: str, max_model_len: int, max_num_seqs: int) -> int:
    """KV cache for max_num_seqs full-length sequences (+1 layer: the EAGLE-3 drafter), capped at a
    quarter of free memory (GPU when there is one, else RAM): past the cap vLLM queues requests."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * (config.num_hidden_layers + 1) * kv_heads * head_dim * itemsize
    need = per_token * max_num_seqs * (max_model_len + 16)  # + one 16-token block of slack per sequence
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(16, int(min(need, free // 4) // 2**20) + 1)
