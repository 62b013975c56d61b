"""Per-generate state of the rollout engine: running rows, output buffers, the result record."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tlt.rollout.torch_engine.cache import SlotCache
from tlt.rollout.guard import StepLog
from tlt.rollout.batch import RolloutBatch
from tlt.rollout.stats import RolloutStats


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid [U, L] (left padding False) -> [U, 1, L, L] causal mask; pad queries see themselves (no NaN)."""
    n = valid.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    mask = (causal.unsqueeze(0) & valid.unsqueeze(1)) | torch.eye(n, dtype=torch.bool, device=valid.device)
    return mask.unsqueeze(1)


def block_mask(valid: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Cache slots valid [B, S] + mask among the new queries block [B, Q, Q] -> [B, 1, Q, S+Q]."""
    b, q, _ = block.shape
    return torch.cat([valid.unsqueeze(1).expand(b, q, valid.shape[1]), block], dim=2).unsqueeze(1)


@dataclass
class DecodeState:
    """Running rows. pos [B]: position of `last` [B], the newest token (emitted, not yet in the cache).

    pending: drafter inputs not yet fed to the drafter, right-aligned: (tok [B,P], hidden [B,P,H],
    pos [B,P], valid [B,P]); dpast/dvalid: the drafter's own KV cache and its slot mask.
    """
    rows: torch.Tensor
    cache: SlotCache
    pos: torch.Tensor
    last: torch.Tensor
    n_out: torch.Tensor
    prompts: list[list[int]]
    pending: tuple | None = None
    dpast: tuple | None = None
    dvalid: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.rows.shape[0])

    def add_pending(self, tok, hidden, pos, valid) -> None:
        new = (tok, hidden, pos, valid.bool())
        if self.pending is None:
            self.pending = new
        else:
            self.pending = tuple(torch.cat([a, b], 1) for a, b in zip(self.pending, new))

    def select(self, idx: torch.Tensor) -> None:
        """Keep rows `idx` ([B'] long) everywhere."""
        self.rows, self.pos, self.last, self.n_out = (t[idx] for t in (self.rows, self.pos, self.last, self.n_out))
        self.prompts = [self.prompts[i] for i in idx.tolist()]
        self.cache.select(idx)
        if self.pending is not None:
            self.pending = tuple(t[idx] for t in self.pending)
        if self.dpast is not None:
            self.dpast = (self.dpast[0][idx], self.dpast[1][idx])
            self.dvalid = self.dvalid[idx]


@dataclass
class Outputs:
    """Output buffers over all sequences N (indexed by `DecodeState.rows`) and engine stats."""
    tok: torch.Tensor       # [N, max_new] long
    lp: torch.Tensor        # [N, max_new] float
    n: torch.Tensor         # [N] tokens written
    done: torch.Tensor      # [N] bool
    eos: torch.Tensor       # [N] bool
    drafted: torch.Tensor   # [N] long
    accepted: torch.Tensor  # [N] long
    passes: torch.Tensor    # [N] long
    max_new: int
    stats: RolloutStats
    capture: object = None  # engine.Capture when generate(capture=...)
    group_size: int = 1     # sequence i belongs to GRPO group i // group_size
    steps: StepLog = field(default_factory=StepLog)  # step timings for the spec guard

    @classmethod
    def empty(cls, n: int, max_new: int, device) -> "Outputs":
        z = lambda dt=torch.long: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        return cls(torch.zeros(n, max_new, dtype=torch.long, device=device),
                   torch.zeros(n, max_new, dtype=torch.float32, device=device), z(), z(torch.bool),
                   z(torch.bool), z(), z(), z(), max_new, RolloutStats())

    def emit(self, st: DecodeState, toks: torch.Tensor, lps: torch.Tensor, count: torch.Tensor,
             eos: torch.Tensor) -> torch.Tensor:
        """Append up to count[b] tokens toks [B, m] (log-probs lps [B, m]) per row.

        Truncates at the first EOS (kept) and at max_new; marks finished rows. Returns the
        number of tokens actually written per row [B].
        """
        b, m = toks.shape
        j = torch.arange(m, device=toks.device)
        count = torch.minimum(count, self.max_new - st.n_out)
        is_eos = torch.isin(toks, eos) & (j < count[:, None])
        hit = is_eos.any(1)
        count = torch.where(hit, is_eos.to(torch.int8).argmax(1) + 1, count)
        sel = j < count[:, None]
        r = st.rows[:, None].expand(b, m)[sel]
        c = (st.n_out[:, None] + j)[sel]
        self.tok[r, c] = toks[sel]
        self.lp[r, c] = lps[sel].float()
        st.n_out = st.n_out + count
        self.n[st.rows] = st.n_out
        self.done[st.rows] |= hit | (st.n_out >= self.max_new)
        self.eos[st.rows] |= hit
        return count

    def to_batch(self, prompts: list[list[int]], group_size: int) -> RolloutBatch:
        n = self.n.tolist()
        toks, lps = self.tok.tolist(), self.lp.tolist()
        self.stats.tokens = int(sum(n))
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompts for _ in range(group_size)],
            response_ids=[t[:k] for t, k in zip(toks, n)], logprobs=[lp[:k] for lp, k in zip(lps, n)],
            group_index=[i // group_size for i in range(len(n))], finished_eos=self.eos.tolist(),
            drafted=self.drafted.tolist(), accepted=self.accepted.tolist(), target_passes=self.passes.tolist(),
            stats=self.stats)
