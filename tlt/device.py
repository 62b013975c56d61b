"""Where the policy lives and updates (`trainer.device`), and CPU copies of what leaves the process.

`trainer.device`:
  - auto: the current CUDA device when torch sees one, else the CPU. Resolved in each process
    that holds a copy of the policy: the driver (tlt run), and on Ray every trainer rank, which
    sees the one GPU Ray gave it (`cluster.trainer_gpus`) as cuda:0.
  - cpu / cuda: as named. cuda on a machine without CUDA is refused before anything starts
    (tlt.inputs.check_device), so a recipe that says cuda still passes `tlt config check` on a
    CPU-only machine.
The drafter is built on the policy's device; the RL step builds its batches there, and the
update moves every micro-batch onto its model's device. Whatever leaves the process (checkpoint
files, the optimizer state, Ray object-store pushes, the spot trainer's shared weights, vLLM's
safetensors) is copied to the CPU first with `to_cpu`.
"""
from __future__ import annotations

from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")


def no_cuda_message(key: str = "trainer.device") -> str:
    """The paragraph that refuses `cuda` where torch sees no CUDA device."""
    return (f"{key}: cuda, but torch sees no CUDA device here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES as set). Run on a machine with a GPU and a CUDA "
            f"build of torch, or set {key}: auto (the GPU where there is one, else the CPU) or {key}: cpu.")


def resolve_device(setting: str = "auto") -> torch.device:
    """'auto' | 'cpu' | 'cuda' -> the torch device this process trains on (cuda: the current device,
    cuda:0 in a Ray actor that was given one GPU)."""
    if setting not in DEVICES:
        raise ValueError(f"trainer.device must be one of {DEVICES}, not {setting!r}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from tlt.errors import UserError  # deferred: keeps this module's imports to torch

        raise UserError(no_cuda_message())
    return torch.device("cuda", torch.cuda.current_device())


def module_device(module) -> torch.device:
    """The device of a module's (or a DeepSpeed engine's) first parameter; the CPU when it has none."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor detached and on the CPU (tensors already there are returned as they
    are, not copied), through dicts, lists and tuples: for anything that leaves the process."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, to_cpu(v)) for k, v in obj.items())  # dict, OrderedDict (a state dict)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
