"""Speculative decoding round: draft a tree, verify it in one target forward, accept losslessly.

A draft tree per row has N nodes (padding allowed); in the verify block the root (index 0) is
the row's newest token `last` and node q (1..N) attends to the cache plus its ancestors (a 4D
boolean mask; HF Llama/Qwen2 in transformers 5 pass a 4D mask to SDPA unchanged). A chain is
the tree with one child per node (topk = 1).

Acceptance walks down from the root: greedy accepts the child equal to the target argmax
(so outputs are identical to plain greedy decoding); sampling tries the children as point-mass
proposals with recursive rejection (`sampling.reject_siblings`), then samples the bonus token
from the residual, so outputs follow the policy p exactly (top-p applied to p). Rows accept
different lengths: the cache keeps each row's accepted slots (`SlotCache.keep_slots`) and masks
the rest; positions are per-row counters.

EAGLE-3 alignment: drafter position t takes (fuse(target aux_t), token_{t+1}) and predicts
token_{t+2}. After a round, the target's aux states of the root and the accepted nodes (from
the verify forward itself) go to the drafter as pending inputs; their last entry is the
first draft step of the next round.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tlt.config import SpecStrategy
from tlt.rollout.cache import compact_past
from tlt.rollout.sampling import draw, reject_siblings, target_probs, token_logprobs
from tlt.rollout.state import DecodeState, Outputs, block_mask


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


# ---- drafting -------------------------------------------------------------------------------
def propose_ngram(engine, st: DecodeState, outs: Outputs, strategy: SpecStrategy) -> DraftTree:
    """N-gram lookup tree per row over prompt + generated tokens and, with `group_drafts`, the
    other samples of its group (their tokens so far) and the prompt's earlier responses."""
    n_out = outs.n.tolist()
    gen = outs.tok.tolist()
    own = [p + gen[r][:n_out[r]] for r, p in zip(st.rows.tolist(), st.prompts)]
    refs = [()] * st.size
    if engine.cfg.group_drafts:
        # Each reference starts with the prompt's last max_n tokens (the group shares the prompt), so a
        # member's tokens match at their own offset before anything that merely repeats later.
        g, k = outs.group_size, engine.ngram.max_n
        refs = [[p[-k:] + gen[j][:n_out[j]] for j in range(r // g * g, r // g * g + g) if j != r]
                + [p[-k:] + h.tolist() for h in engine.history.get(p)] for r, p in zip(st.rows.tolist(), st.prompts)]
    rows = [engine.ngram.propose(seq, strategy.depth, strategy.topk, strategy.tokens, ref)
            for seq, ref in zip(own, refs)]
    return tree_from_nodes(rows, engine.device)


def propose_eagle(engine, st: DecodeState, strategy: SpecStrategy, temperature: float = 0.0,
                  gen=None) -> tuple[DraftTree, torch.Tensor | None]:
    """Feed the pending target states to the drafter, then grow a top-k tree (EAGLE-2 style), or,
    for a chain (topk 1), the fast path `grow_chain`. Returns (tree, q): q [B,D,Vd] the drafter
    distributions the chain was *sampled* from (temperature > 0), else None (point-mass drafts)."""
    dr = engine.drafter
    tok, hid, pos, valid = st.pending
    key_mask = valid if st.dvalid is None else torch.cat([st.dvalid, valid], 1)
    h, logits, past = dr(tok, hid, pos, past=st.dpast, key_mask=key_mask)
    st.dpast, st.dvalid = compact_past(past, key_mask)
    st.pending = None
    p_min = engine.cfg.draft_min_prob
    min_logp = math.log(p_min) if p_min > 0 else -math.inf
    if strategy.topk == 1:
        stop = engine.cfg.draft_stop_below
        return grow_chain(dr, st, h[:, -1], logits[:, -1], strategy.depth, temperature, gen, min_logp,
                          engine.calibrator if stop > 0 else None, stop)
    return grow_tree(dr, st, h[:, -1], logits[:, -1], strategy, min_logp), None


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
    `calibrator` (tlt.rollout.calibrate), so are drafts whose calibrated chance of being used
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


# ---- acceptance -----------------------------------------------------------------------------
def accept_greedy(logits: torch.Tensor, tree: DraftTree):
    """logits [B,Q,V] -> (path [B,P] verify indices from the root, n_acc [B], bonus [B])."""
    tgt = logits.argmax(-1)  # [B, Q]
    bsz = tgt.shape[0]
    cur = torch.zeros(bsz, dtype=torch.long, device=tgt.device)
    alive = torch.ones(bsz, dtype=torch.bool, device=tgt.device)
    n_acc = torch.zeros_like(cur)
    path = [cur]
    for _ in range(int(tree.depth.max()) if tree.depth.numel() else 0):
        want = tgt.gather(1, cur[:, None])
        match = (tree.parent == cur[:, None]) & (tree.tokens == want) & tree.valid & alive[:, None]
        found = match.any(1)
        cur = torch.where(found, match.to(torch.int8).argmax(1) + 1, cur)
        alive &= found
        n_acc += found.long()
        path.append(cur)
        if not bool(alive.any()):
            break
    return torch.stack(path, 1), n_acc, tgt.gather(1, cur[:, None]).squeeze(1)


def accept_sampled(logits: torch.Tensor, tree: DraftTree, temperature: float, top_p: float, gen):
    """Recursive rejection sampling down the tree; same outputs as `accept_greedy`."""
    bsz = logits.shape[0]
    dev = logits.device
    if tree.tokens.shape[1] == 0:  # no drafts at all: one invalid node keeps the shapes non-empty
        z = torch.zeros(bsz, 1, dtype=torch.long, device=dev)
        tree = DraftTree(z, z, z, z.bool())
    cur = torch.zeros(bsz, dtype=torch.long, device=dev)
    alive = torch.ones(bsz, dtype=torch.bool, device=dev)
    n_acc, bonus = torch.zeros_like(cur), torch.zeros_like(cur)
    path = [cur]
    while bool(alive.any()):
        probs = target_probs(logits[torch.arange(bsz, device=dev), cur], temperature, top_p)  # [B, V]
        child = (tree.parent == cur[:, None]) & tree.valid & alive[:, None]  # [B, N]
        n_c = max(1, int(child.sum(1).max()))
        order = torch.argsort((~child).to(torch.int8), dim=1, stable=True)[:, :n_c]
        acc, choice, res = reject_siblings(probs, tree.tokens.gather(1, order), child.gather(1, order), gen)
        acc &= alive
        dying = torch.nonzero(alive & ~acc).squeeze(1)
        if dying.numel():
            bonus[dying] = draw(res[dying], gen)
        cur = torch.where(acc, order.gather(1, choice[:, None]).squeeze(1) + 1, cur)
        n_acc += acc.long()
        alive = acc
        path.append(cur)
    return torch.stack(path, 1), n_acc, bonus


def accept_chain_sampled(logits: torch.Tensor, tree: DraftTree, q: torch.Tensor, draft_ids: torch.Tensor,
                         temperature: float, top_p: float, gen):
    """Speculative sampling of a chain drafted from q (Leviathan et al. 2023; Chen et al. 2023).

    logits [B,D+1,V] target logits at the root and the D drafts; q [B,D,Vd] the drafter
    distributions the drafts were sampled from, over draft ids (`draft_ids` [Vd] -> target id).
    Draft j is accepted with probability min(1, p_j(x)/q_j(x)); at the first rejection the bonus
    is drawn from norm(max(0, p_j - q_j)); after a fully accepted (or pruned-short) chain from
    p. Output tokens follow p exactly, whatever q is. Same outputs as `accept_greedy`.
    """
    bsz, d = tree.tokens.shape
    dev = logits.device
    probs = target_probs(logits[:, : d + 1], temperature, top_p)  # [B, D+1, V]
    if d == 0:
        z = torch.zeros(bsz, dtype=torch.long, device=dev)
        return z[:, None], z, draw(probs[:, 0], gen)
    qf = torch.zeros(bsz, d, probs.shape[-1], device=dev)
    qf[:, :, draft_ids] = q.float()
    tok = tree.tokens[..., None]
    px, qx = probs[:, :d].gather(2, tok).squeeze(2), qf.gather(2, tok).squeeze(2)
    u = torch.rand(bsz, d, generator=gen, device=dev)
    ok = (u * qx < px) & tree.valid
    n_acc = ok.long().cumprod(1).sum(1)  # [B]
    at = n_acc.clamp_max(max(d - 1, 0))
    rows = torch.arange(bsz, device=dev)
    p_at = probs[rows, n_acc]
    rejected = (n_acc < d) & tree.valid[rows, at]
    res = (p_at - qf[rows, at]).clamp_min(0) if d else p_at
    res = torch.where((rejected & (res.sum(-1) > 0))[:, None], res, p_at)
    bonus = draw(res / res.sum(-1, keepdim=True), gen)
    path = torch.minimum(torch.arange(d + 1, device=dev)[None], n_acc[:, None])
    return path, n_acc, bonus


# ---- one round ------------------------------------------------------------------------------
def spec_round(engine, st: DecodeState, strategy: SpecStrategy, opts: dict, gen, outs: Outputs) -> int:
    """Draft, verify, accept, emit, update the caches. Returns the tokens emitted this round."""
    eagle = engine.drafter is not None  # the verify forward feeds it (also in n-gram rounds: its cache stays whole)
    model_drafts = eagle and strategy.source == "drafter"
    q = None
    if model_drafts:
        temp = opts["temperature"] if engine.cfg.sampled_drafts else 0.0  # 0: argmax drafts, point-mass rule
        tree, q = propose_eagle(engine, st, strategy, temp, gen)
    else:
        tree = propose_ngram(engine, st, outs, strategy)
    bsz = st.size
    ids = torch.cat([st.last[:, None], tree.tokens], 1)  # [B, Q]
    pos = st.pos[:, None] + torch.cat([torch.zeros_like(st.pos)[:, None], tree.depth], 1)
    start = st.cache.length
    logits, fused = engine.forward(ids, pos, block_mask(st.cache.valid, ancestor_mask(tree)), st.cache, hidden=eagle)
    if opts["temperature"] <= 0:
        path, n_acc, bonus = accept_greedy(logits, tree)
    elif q is not None:
        path, n_acc, bonus = accept_chain_sampled(logits, tree, q, engine.drafter.draft_to_target_ids(),
                                                  opts["temperature"], opts["top_p"], gen)
    else:
        path, n_acc, bonus = accept_sampled(logits, tree, opts["temperature"], opts["top_p"], gen)
    m = int(n_acc.max()) + 1
    path = path[:, :m]
    j = torch.arange(m, device=ids.device)
    keep = j[None] <= n_acc[:, None]  # root + accepted nodes go to the cache
    st.cache.keep_slots(start, path, keep)
    emitted = torch.cat([ids.gather(1, path)[:, 1:], bonus[:, None]], 1)
    emitted.scatter_(1, n_acc[:, None], bonus[:, None])  # the bonus follows the last accepted draft
    path_logits = logits.gather(1, path[..., None].expand(bsz, m, logits.shape[-1]))
    count = outs.emit(st, emitted, token_logprobs(path_logits, emitted), n_acc + 1, engine.eos)
    if eagle:
        _queue_drafter_inputs(st, emitted, fused.gather(1, path[..., None].expand(bsz, m, fused.shape[-1])), keep)
    st.pos = st.pos + n_acc + 1
    st.last = bonus
    if tree.conf is not None and engine.cfg.draft_stop_below > 0:
        engine.calibrator.update(tree.conf, tree.valid, n_acc)
    _record(outs, st, tree, n_acc, count, ngram=not model_drafts)
    return int(count.sum())


def _queue_drafter_inputs(st: DecodeState, emitted, hidden, keep) -> None:
    """Right-align (hidden of root+accepted, next token) per row and append them to the drafter's
    pending inputs (an n-gram round leaves the earlier ones unconsumed)."""
    bsz, m = emitted.shape
    shift = m - keep.sum(1, keepdim=True)  # [B, 1]
    src = (torch.arange(m, device=emitted.device)[None] - shift).clamp_min(0)  # [B, m]
    valid = torch.arange(m, device=emitted.device)[None] >= shift
    tok = emitted.gather(1, src)
    hid = hidden.gather(1, src[..., None].expand(bsz, m, hidden.shape[-1]))
    st.add_pending(tok, hid, st.pos[:, None] + src, valid)


def _record(outs: Outputs, st: DecodeState, tree: DraftTree, n_acc, count, ngram: bool = False) -> None:
    outs.drafted[st.rows] += tree.valid.sum(1)
    outs.accepted[st.rows] += n_acc
    outs.passes[st.rows] += 1
    s = outs.stats
    s.spec_steps += 1
    s.spec_row_passes += st.size
    s.spec_tokens += int(count.sum())
    if ngram:
        s.ngram_row_passes += st.size
        s.ngram_tokens += int(count.sum())
    s.count_positions((tree.depth * tree.valid).amax(1) if tree.depth.numel() else n_acc * 0, n_acc)
