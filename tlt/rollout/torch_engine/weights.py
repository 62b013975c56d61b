"""The torch engine's own copy of a model in `rollout.dtype` (e.g. bf16 on a bf16-capable CPU or GPU
while the update keeps fp32 master weights; tlt.precision).

The copy is rounded from the master weights whenever their version moved (tlt.versions:
every write site bumps it), so a rollout with unchanged weights copies nothing.
"""
from __future__ import annotations

import copy

import torch

from tlt.versions import Synced


class RolloutCopy:
    """`module`: a frozen, eval-mode copy of the master model in `dtype` (ties kept)."""

    def __init__(self, master, dtype: torch.dtype):
        self.dtype = dtype
        self.module = copy.deepcopy(master).to(dtype).eval().requires_grad_(False)
        self.synced = Synced(master=master)

    @classmethod
    def of(cls, model, name: str) -> "RolloutCopy | None":
        """A copy when `name` (rollout.dtype) differs from the model's own dtype, else None
        ('auto' here = decode with the model itself; runs resolve 'auto' first, tlt.precision)."""
        if name == "auto" or getattr(torch, name) == next(model.parameters()).dtype:
            return None
        return cls(model, getattr(torch, name))

    @torch.no_grad()
    def refresh(self, master) -> bool:
        """Round the master's weights into the copy if their version moved since the last refresh."""
        if not self.synced.moved(master=master):
            return False
        mine = self.module.state_dict()
        for name, tensor in master.state_dict().items():
            mine[name].copy_(tensor)
        self.synced.take(master=master)
        return True
