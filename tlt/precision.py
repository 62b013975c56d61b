"""Mixed precision: what is stored (fp32 master weights and optimizer state) apart from what is
computed (bf16 matmuls), as torch AMP, FSDP's MixedPrecision and Megatron's distributed optimizer do.

`trainer.precision` / `drafter.precision`:
  - fp32: store and compute in fp32.
  - bf16-mixed: the parameters stay fp32 (they are the master weights; the optimizer state is
    fp32 too), forward and backward run under `torch.autocast(bfloat16)`, and the loss and its
    reductions are taken in fp32 (logits are cast up before log-softmax). Small updates are
    never rounded away: at lr 1e-6 an AdamW step moves every weight with a gradient, where a pure
    bf16 update keeps ~2 % of them (bf16 holds 8 significant bits: steps under ~1/256 of a
    weight vanish).
  - auto: when a run starts (`resolve_run`), bf16-mixed where the device has bf16 units (CUDA
    with bf16, or a CPU with AVX512-BF16 / AMX and oneDNN), else fp32, with the reason logged as a
    run parameter. A component handed 'auto' directly (a library call, a test) computes in fp32.
`rollout.dtype` is the rollout engines' copy of the weights (auto: bfloat16 when the update is
bf16-mixed, else the model's dtype); they receive it rounded from the master weights at each sync.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

PRECISIONS = ("auto", "fp32", "bf16-mixed")


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_support(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """(whether bf16 matmuls run on real units of `device`, the reason in words)."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA device with bf16" if ok else "this CUDA device has no bf16 support"
    if not torch.backends.mkldnn.is_available():
        return False, "torch was built without oneDNN (mkldnn): bf16 matmuls would be emulated"
    flags = _cpu_flags()
    units = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if units:
        return True, f"CPU with {' and '.join(units)} (oneDNN bf16 kernels)"
    return False, "this CPU has no avx512_bf16 / amx_bf16 units: bf16 would be emulated and slower than fp32"


def resolve(precision: str, device: torch.device | str = "cpu") -> tuple[str, str]:
    """'auto' | 'fp32' | 'bf16-mixed' -> (the concrete precision, why)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    if precision != "auto":
        return precision, "set in the config"
    ok, why = bf16_support(device)
    return ("bf16-mixed" if ok else "fp32"), why


def compute_dtype(precision: str) -> torch.dtype | None:
    """bfloat16 for bf16-mixed, else None (plain fp32). 'auto' is resolved when a run starts
    (`resolve_run`); a component handed 'auto' directly (a library call, a test) computes in fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    return torch.bfloat16 if precision == "bf16-mixed" else None


def autocast(precision: str, device: torch.device | str = "cpu"):
    """The forward's context: bf16 autocast for bf16-mixed, nothing for fp32."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def rollout_dtype(name: str, update_precision: str, model_dtype: torch.dtype) -> torch.dtype:
    """The rollout copy's dtype: `rollout.dtype`, or (auto) bf16 when the update computes in bf16."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if compute_dtype(update_precision) is not None else model_dtype


def default_device() -> torch.device:
    """Where the update computes: the GPU when there is one (DeepSpeed places it there), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_run(cfg, device: torch.device | str | None = None):
    """(cfg with concrete `trainer.precision`, `drafter.precision` and `rollout.dtype`, one line per
    choice saying why): what a run logs as its params, so a run is reproducible on other hardware."""
    device = default_device() if device is None else device
    trainer, why_t = resolve(cfg.trainer.precision, device)
    drafter_in = trainer if cfg.drafter.precision == "auto" else cfg.drafter.precision
    drafter, why_d = resolve(drafter_in, device)
    master = getattr(torch, cfg.model.dtype)
    rollout = str(rollout_dtype(cfg.rollout.dtype, trainer, master)).removeprefix("torch.")
    out = cfg.model_copy(deep=True)
    out.trainer.precision, out.drafter.precision, out.rollout.dtype = trainer, drafter, rollout
    notes = [f"trainer.precision={trainer} ({why_t})", f"drafter.precision={drafter} ({why_d})",
             f"rollout.dtype={rollout} ({'set in the config' if cfg.rollout.dtype != 'auto' else 'follows the update'})"]
    return out, notes
