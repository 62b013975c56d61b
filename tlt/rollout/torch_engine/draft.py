"""Draft trees of the torch engine's speculative round: the tree record and its ancestor mask,
EAGLE chains (greedy or sampled, with confidence pruning) and top-k trees (EAGLE-2 style)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tlt.config import SpecStrategy
from tlt.rollout.torch_engine.sampling import draw
from tlt.rollout.torch_engine.state import DecodeState


@dataclass
class DraftTree:
    """tokens [B,N] target ids; parent [B,N] verify-block index of the parent (0 = root);
    depth [B,N] (1 = child of the root); valid [B,N] (False = padding); conf [B,N] the drafter's
    probability of each draft (chains: what the calibrator learns from), or None."""
    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    conf: torch.Tensor | None = None


def tree_from_nodes(rows: list[list[tuple[int, int, int]]], device) -> DraftTree:
    """Per-row node lists (token, parent, depth), parents before children -> padded DraftTree."""
    n = max((len(r) for r in rows), default=0)
    data = torch.zeros(len(rows), n, 3, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, r in enumerate(rows):
        if r:
            data[b, : len(r)] = torch.tensor(r, dtype=torch.long)
            valid[b, : len(r)] = True
    data, valid = data.to(device), valid.to(device)
    return DraftTree(data[..., 0], data[..., 1], data[..., 2], valid)


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[B, Q, Q] bool, Q = N+1: query i sees key j iff j is i or an ancestor of i (root sees itself)."""
    b, n = tree.tokens.shape
    par = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=tree.tokens.device), tree.parent], 1)
    mask = torch.eye(n + 1, dtype=torch.bool, device=par.device).expand(b, n + 1, n + 1).clone()
    depth = int(tree.depth.max()) if n else 0
    for _ in range(depth):  # after d rounds every node has absorbed its ancestors up to depth d
        mask |= mask.gather(1, par.unsqueeze(2).expand(b, n + 1, n + 1))
    return mask


def _draft_token(logits: torch.Tensor, temperature: float, gen
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One draft per row: the argmax (greedy) or a draw from q = softmax(logits / T); returns the
    tokens, the drafter's log-probs and q (None when greedy)."""
    lp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), -1)
    if temperature <= 0:
        return lp.argmax(-1), lp, None
    q = lp.exp()
    return draw(q, gen), lp, q


def grow_chain(dr, st: DecodeState, h_last: torch.Tensor, logits: torch.Tensor, depth: int, temperature: float,
               gen, min_logp: float = -math.inf, calibrator=None, stop_below: float = 0.0
               ) -> tuple[DraftTree, torch.Tensor | None]:
    """A chain of `depth` drafts, no beam bookkeeping (no KV repeats or gathers).

    Greedy (temperature 0): each draft is the drafter's argmax. Sampled: each draft is drawn from
    q = softmax(drafter logits / T) and q is returned, so verification can accept with
    min(1, p/q) (`accept_chain_sampled`): 1 - TV(p, q) per position instead of p(x).
    Drafts whose cumulative drafter log-prob falls under `min_logp` are pruned; with a
    `calibrator` (tlt.rollout.torch_engine.calibrate), so are drafts whose calibrated chance of being used
    (all drafts before it accepted too) is under `stop_below`, and the chain stops growing once
    every row is under it (the first draft is always kept).
    """
    bsz = st.size
    toks, qs, logq, conf = [], [], [], []
    alive = torch.ones(bsz, dtype=torch.bool, device=logits.device)
    keep, used = [], torch.ones(bsz, device=logits.device)
    past, kmask = st.dpast, st.dvalid
    ones = torch.ones(bsz, 1, dtype=torch.bool, device=logits.device)
    for level in range(depth):
        t, lp, q = _draft_token(logits, temperature, gen)
        if q is not None:
            qs.append(q)
        toks.append(t)
        logq.append(lp.gather(1, t[:, None]).squeeze(1))
        conf.append(logq[-1].exp())
        if calibrator is not None:
            used = used * calibrator.acceptance(level, conf[-1])
            alive = alive & ((used >= stop_below) | (level == 0))
        keep.append(alive)
        if level == depth - 1 or bool((torch.stack(logq, 1).sum(1) < min_logp).all()) or not bool(alive.any()):
            break
        kmask = torch.cat([kmask, ones], 1)
        h, lg, past = dr(dr.to_target_ids(t)[:, None], h_last[:, None], (st.pos + level)[:, None],
                         past=past, key_mask=kmask)
        h_last, logits = h[:, -1], lg[:, -1]
    d = len(toks)
    tok = dr.to_target_ids(torch.stack(toks, 1))
    ar = torch.arange(d, device=tok.device).expand(bsz, d)
    tree = DraftTree(tok, ar.clone(), ar + 1, torch.ones_like(tok, dtype=torch.bool), torch.stack(conf, 1))
    ok = torch.stack(keep, 1)
    if min_logp > -math.inf:
        ok = ok & (torch.stack(logq, 1).cumsum(1) >= min_logp)
    if not bool(ok.all()):
        tree = prune_tree(tree, ok)
        qs = qs[: tree.tokens.shape[1]]
    return tree, (torch.stack(qs, 1) if qs else None)


def grow_tree(dr, st: DecodeState, h_last: torch.Tensor, logits: torch.Tensor, strategy: SpecStrategy,
              min_logp: float = -math.inf) -> DraftTree:
    """Beam-expand k nodes per level for `depth` levels, keep the `tokens` best by cumulative log-prob.

    h_last [B,H], logits [B,Vd]: the drafter's output for the newest committed position.
    Nodes whose cumulative log-prob is under `min_logp` are dropped (`prune_tree`), and the beam
    stops growing once every beam is under it (a child never scores above its parent).
    """
    k, bsz = strategy.topk, st.size
    score, tok = torch.log_softmax(logits.float(), -1).topk(k, -1)  # [B, k]
    cands = [(tok, score, torch.full_like(tok, -1), 1)]
    beam_node = torch.arange(k, device=tok.device).expand(bsz, k)
    beam_h = h_last[:, None].expand(bsz, k, h_last.shape[-1])
    past = tuple(t.repeat_interleave(k, 0) for t in st.dpast)
    kmask = st.dvalid.repeat_interleave(k, 0)
    n_cand = k
    ones = torch.ones(bsz * k, 1, dtype=torch.bool, device=tok.device)
    for level in range(1, strategy.depth):
        if bool((score < min_logp).all()):
            break
        kmask = torch.cat([kmask, ones], 1)
        p = (st.pos + level - 1).repeat_interleave(k)[:, None]
        h, lg, past = dr(dr.to_target_ids(tok).reshape(-1, 1), beam_h.reshape(bsz * k, 1, -1), p,
                         past=past, key_mask=kmask)
        s2, t2 = torch.log_softmax(lg[:, -1].float(), -1).view(bsz, k, -1).topk(k, -1)  # [B, k, k]
        s2 = (score[:, :, None] + s2).reshape(bsz, k * k)
        t2 = t2.reshape(bsz, k * k)
        cands.append((t2, s2, beam_node[:, :, None].expand(bsz, k, k).reshape(bsz, k * k), level + 1))
        score, sel = s2.topk(k, -1)
        parent_beam = sel // k
        beam_node, tok = n_cand + sel, t2.gather(1, sel)
        n_cand += k * k
        beam_h = h[:, -1].view(bsz, k, -1).gather(1, parent_beam[..., None].expand(bsz, k, h.shape[-1]))
        rows = (torch.arange(bsz, device=tok.device)[:, None] * k + parent_beam).reshape(-1)
        past = (past[0][rows], past[1][rows])
    return select_tree(dr, cands, strategy.tokens, min_logp)


def select_tree(dr, cands, n_keep: int, min_logp: float = -math.inf) -> DraftTree:
    """Top `n_keep` candidates by score (parents score >= children, ties go to the shallower),
    minus those scoring under `min_logp`."""
    tok = torch.cat([c[0] for c in cands], 1)
    score = torch.cat([c[1] for c in cands], 1)
    parent = torch.cat([c[2] for c in cands], 1)
    depth = torch.cat([torch.full_like(c[0], c[3]) for c in cands], 1)
    n = min(n_keep, tok.shape[1])
    sel = (score - 1e-4 * depth).topk(n, -1).indices.sort(-1).values  # candidate order = topological
    qidx = torch.full_like(tok, -1).scatter_(1, sel, torch.arange(1, n + 1, device=tok.device).expand_as(sel))
    par = parent.gather(1, sel)
    par_q = torch.where(par >= 0, qidx.gather(1, par.clamp_min(0)), 0)
    tree = DraftTree(dr.to_target_ids(tok.gather(1, sel)), par_q.clamp_min(0), depth.gather(1, sel), par_q >= 0)
    return prune_tree(tree, score.gather(1, sel) >= min_logp) if min_logp > -math.inf else tree


def prune_tree(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """Invalidate nodes where `keep` [B,N] is False and drop the columns no row keeps, so the
    verify block shrinks. `keep` must be closed under ancestors (a kept node's parent is kept)."""
    valid = tree.valid & keep
    cols = valid.any(0)  # [N]
    new_idx = torch.cumsum(cols.long(), 0)  # verify index (1-based) of each kept column
    idx = torch.nonzero(cols).squeeze(1)
    parent = tree.parent[:, idx]
    parent = torch.where((parent > 0) & valid[:, idx], new_idx[(parent - 1).clamp_min(0)], 0)
    return DraftTree(tree.tokens[:, idx], parent, tree.depth[:, idx], valid[:, idx],
                     None if tree.conf is None else tree.conf[:, idx])
