"""Slot KV cache for batched, ragged decoding with HF models.

Every layer keeps keys/values in a preallocated buffer `[B, n_kv, cap, hd]`; a forward writes its
`q` new slots in place (no `torch.cat` of the whole cache per step, unlike `DynamicCache`). Slots
are *not* token positions: each row keeps its own validity mask `valid [B, S]` (False = left
padding or a rejected draft) and its own RoPE position counter, so rows accept different numbers
of draft tokens without moving data. `compact` right-aligns the valid slots when waste grows.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's KV in a growable buffer; `length` slots are in use."""

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, q, d = key_states.shape
        cap = max(self.reserve, q)
        self.kbuf = key_states.new_empty(b, h, cap, d)
        self.vbuf = value_states.new_empty(b, h, cap, value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True

    def _grow(self, need: int) -> None:
        cap = self.kbuf.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self._grow(self.length + q)
        self.kbuf[:, :, self.length: self.length + q] = key_states
        self.vbuf[:, :, self.length: self.length + q] = value_states
        self.length += q
        return self.kbuf[:, :, : self.length], self.vbuf[:, :, : self.length]

    @property
    def keys(self):  # read-only views for HF utilities that peek at `.keys`
        return self.kbuf[:, :, : self.length] if self.is_initialized else None

    @keys.setter
    def keys(self, value):  # DynamicLayer.__init__/reset assign None; the buffer is ours
        pass

    @property
    def values(self):
        return self.vbuf[:, :, : self.length] if self.is_initialized else None

    @values.setter
    def values(self, value):
        pass

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.kbuf = self.kbuf.repeat_interleave(repeats, dim=0)
            self.vbuf = self.vbuf.repeat_interleave(repeats, dim=0)

    def gather_slots(self, start: int, index: torch.Tensor) -> None:
        """Keep, per row, slots `start + index[b]` ([B, m]) as slots start..start+m; drop the rest."""
        b, m = index.shape
        for name in ("kbuf", "vbuf"):
            buf = getattr(self, name)
            idx = (start + index).view(b, 1, m, 1).expand(b, buf.shape[1], m, buf.shape[3])
            picked = torch.gather(buf[:, :, : self.length], 2, idx)
            buf[:, :, start: start + m] = picked
        self.length = start + m


class SlotCache(Cache):
    """A `Cache` of `SlotLayer`s plus the per-row slot validity mask `valid [B, S]`."""

    def __init__(self, num_layers: int, reserve: int = 0):
        super().__init__(layers=[SlotLayer(reserve) for _ in range(num_layers)])
        self.valid: torch.Tensor | None = None  # Bool [B, S]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def select(self, indices: torch.Tensor) -> None:
        """Keep batch rows `indices` ([B'] long)."""
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self.valid = self.valid[indices]

    def repeat_rows(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        self.valid = self.valid.repeat_interleave(repeats, dim=0)

    def keep_slots(self, start: int, index: torch.Tensor, keep: torch.Tensor) -> None:
        """After a verify block written at `start`: keep slots `start+index` ([B, m]); `keep` [B, m] marks real ones."""
        for layer in self.layers:
            layer.gather_slots(start, index)
        self.valid = torch.cat([self.valid[:, :start], keep], dim=1)

    def compact(self, min_waste: float = 0.25) -> None:
        """Right-align each row's valid slots and drop columns no row uses, when the waste is large."""
        valid = self.valid
        counts = valid.sum(1)
        width = int(counts.max()) if counts.numel() else 0
        total = valid.shape[1]
        if total == 0 or (total - width) / total < min_waste:
            return
        order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, total - width:]  # [B, width]
        for layer in self.layers:
            layer.gather_slots(0, order)
        self.valid = torch.gather(valid, 1, order)


def compact_past(past: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor, min_waste: float = 0.5):
    """Same right-alignment for a plain (k, v) cache, each [B, n_kv, S, hd], with valid [B, S]."""
    total = valid.shape[1]
    width = int(valid.sum(1).max()) if valid.numel() else 0
    if total == 0 or (total - width) / total < min_waste:
        return past, valid
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, total - width:]
    k, v = past
    idx = order[:, None, :, None].expand(k.shape[0], k.shape[1], width, k.shape[3])
    return (torch.gather(k, 2, idx), torch.gather(v, 2, idx)), torch.gather(valid, 1, order)
