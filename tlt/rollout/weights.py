"""Weights as the rollout engines see them: content fingerprints (`fingerprint`, `digest`) that tell
when the policy or the drafter changed, and the torch engine's own copy of the policy in
`rollout.dtype` (e.g. bf16 on a bf16-capable CPU or GPU while the update keeps fp32 master weights;
tlt.precision).

The copy is rounded from the master weights whenever they changed. Changes are found from a
bit-pattern fingerprint of the master, not torch's version counters, which DeepSpeed ZeRO-1/2
writes leave unchanged (`fingerprint`).
"""
from __future__ import annotations

import copy
import hashlib

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_sum(t: torch.Tensor) -> int:
    """Sum of the tensor's raw bit patterns (as integers): any write that changes a value changes it
    (no float rounding can absorb a tiny update), one pass over the data on its own device."""
    flat = t.detach().contiguous().reshape(-1)
    return int(flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64))


def fingerprint(module) -> tuple:
    """(name, identity, bit sum) of every parameter and buffer: changes when any of them is written
    or replaced. The content, not torch's version counter: DeepSpeed ZeRO-1/2 write the updated
    weights through their flat buffers, which leaves the parameters' version counters unchanged
    (measured: a ZeRO-2 step changed every tensor and no counter)."""
    return tuple((k, id(t), bits_sum(t)) for k, t in module.state_dict(keep_vars=True).items())


def digest(module) -> str:
    """Hash of every parameter and buffer's bytes (for the small drafter: a load of the same weights
    bumps version counters, which must not cost an engine rebuild)."""
    h = hashlib.blake2b(digest_size=16)
    for k, t in module.state_dict().items():
        h.update(k.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RolloutCopy:
    """`module`: a frozen, eval-mode copy of the master model in `dtype` (ties kept)."""

    def __init__(self, master, dtype: torch.dtype):
        self.dtype = dtype
        self.module = copy.deepcopy(master).to(dtype).eval().requires_grad_(False)
        self._seen = fingerprint(master)

    @classmethod
    def of(cls, model, name: str) -> "RolloutCopy | None":
        """A copy when `name` (rollout.dtype) differs from the model's own dtype, else None
        ('auto' here = decode with the model itself; runs resolve 'auto' first, tlt.precision)."""
        if name == "auto" or getattr(torch, name) == next(model.parameters()).dtype:
            return None
        return cls(model, getattr(torch, name))

    @torch.no_grad()
    def refresh(self, master) -> bool:
        """Round the master's weights into the copy if they changed since the last refresh."""
        seen = fingerprint(master)
        if seen == self._seen:
            return False
        mine = self.module.state_dict()
        for name, tensor in master.state_dict().items():
            mine[name].copy_(tensor)
        self._seen = seen
        return True
