"""The rollout engine's own copy of the policy in `rollout.dtype` (e.g. bf16 on a bf16-capable CPU
or GPU while the update keeps fp32 master weights; tlt.precision).

The copy is rounded from the master weights whenever they changed. Changes are found from a
bit-pattern fingerprint of the master, not torch's version counters, which DeepSpeed ZeRO-1/2
writes leave unchanged (tlt.rollout.vllm_backend.fingerprint).
"""
from __future__ import annotations

import copy

import torch

from tlt.rollout.vllm_backend import fingerprint


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
