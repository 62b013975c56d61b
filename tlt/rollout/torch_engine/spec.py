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
from typing import Callable

import torch

from tlt.config import SpecStrategy
from tlt.rollout.torch_engine.cache import compact_past
from tlt.rollout.torch_engine.calibrate import Calibrator
from tlt.rollout.torch_engine.ngram import NgramDrafter, PromptHistory
from tlt.rollout.torch_engine.draft import DraftTree, ancestor_mask, grow_chain, grow_tree, tree_from_nodes
from tlt.rollout.torch_engine.sampling import draw, reject_siblings, target_probs, token_logprobs
from tlt.rollout.torch_engine.state import DecodeState, Outputs, block_mask


# ---- what a round needs of its engine ------------------------------------------------------
@dataclass(frozen=True)
class RoundParts:
    """What one speculative round reads of the engine that runs it, handed over explicitly (the
    engine builds one per round, `RolloutEngine.round_parts`, so the round sees a `fixed_strategy`
    block's config and the current drafter copy).

    forward: the target forward (ids, pos, mask, cache, hidden=) -> (logits, fused drafter hidden).
    drafter: the EAGLE drafter in the rollout dtype, or None (n-gram drafts only). ngram / history:
    the n-gram drafter and the prompts' earlier answers (searched when `group_drafts`). calibrator:
    drafter confidence -> acceptance (pruning with `draft_stop_below`). eos: the EOS ids on the
    engine's device. group_drafts, draft_min_prob, draft_stop_below, sampled_drafts: the rollout
    config's drafting knobs."""

    forward: Callable
    drafter: object | None
    ngram: NgramDrafter
    history: PromptHistory
    calibrator: Calibrator
    eos: torch.Tensor
    group_drafts: bool
    draft_min_prob: float
    draft_stop_below: float
    sampled_drafts: bool

    @property
    def device(self) -> torch.device:
        return self.eos.device


# ---- drafting -------------------------------------------------------------------------------
def propose_ngram(parts: RoundParts, st: DecodeState, outs: Outputs, strategy: SpecStrategy) -> DraftTree:
    """N-gram lookup tree per row over prompt + generated tokens and, with `group_drafts`, the
    other samples of its group (their tokens so far) and the prompt's earlier responses."""
    n_out = outs.n.tolist()
    gen = outs.tok.tolist()
    own = [p + gen[r][:n_out[r]] for r, p in zip(st.rows.tolist(), st.prompts)]
    refs = [()] * st.size
    if parts.group_drafts:
        # Each reference starts with the prompt's last max_n tokens (the group shares the prompt), so a
        # member's tokens match at their own offset before anything that merely repeats later.
        g, k = outs.group_size, parts.ngram.max_n
        refs = [[p[-k:] + gen[j][:n_out[j]] for j in range(r // g * g, r // g * g + g) if j != r]
                + [p[-k:] + h.tolist() for h in parts.history.get(p)] for r, p in zip(st.rows.tolist(), st.prompts)]
    rows = [parts.ngram.propose(seq, strategy.depth, strategy.topk, strategy.tokens, ref)
            for seq, ref in zip(own, refs)]
    return tree_from_nodes(rows, parts.device)


def propose_eagle(parts: RoundParts, st: DecodeState, strategy: SpecStrategy, temperature: float = 0.0,
                  gen=None) -> tuple[DraftTree, torch.Tensor | None]:
    """Feed the pending target states to the drafter, then grow a top-k tree (EAGLE-2 style), or,
    for a chain (topk 1), the fast path `grow_chain`. Returns (tree, q): q [B,D,Vd] the drafter
    distributions the chain was *sampled* from (temperature > 0), else None (point-mass drafts)."""
    dr = parts.drafter
    tok, hid, pos, valid = st.pending
    key_mask = valid if st.dvalid is None else torch.cat([st.dvalid, valid], 1)
    h, logits, past = dr(tok, hid, pos, past=st.dpast, key_mask=key_mask)
    st.dpast, st.dvalid = compact_past(past, key_mask)
    st.pending = None
    p_min = parts.draft_min_prob
    min_logp = math.log(p_min) if p_min > 0 else -math.inf
    if strategy.topk == 1:
        stop = parts.draft_stop_below
        return grow_chain(dr, st, h[:, -1], logits[:, -1], strategy.depth, temperature, gen, min_logp,
                          parts.calibrator if stop > 0 else None, stop)
    return grow_tree(dr, st, h[:, -1], logits[:, -1], strategy, min_logp), None


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
def spec_round(parts: RoundParts, st: DecodeState, strategy: SpecStrategy, opts: dict, gen, outs: Outputs) -> int:
    """Draft, verify, accept, emit, update the caches. Returns the tokens emitted this round."""
    eagle = parts.drafter is not None  # the verify forward feeds it (also in n-gram rounds: its cache stays whole)
    model_drafts = eagle and strategy.source == "drafter"
    q = None
    if model_drafts:
        temp = opts["temperature"] if parts.sampled_drafts else 0.0  # 0: argmax drafts, point-mass rule
        tree, q = propose_eagle(parts, st, strategy, temp, gen)
    else:
        tree = propose_ngram(parts, st, outs, strategy)
    bsz = st.size
    ids = torch.cat([st.last[:, None], tree.tokens], 1)  # [B, Q]
    pos = st.pos[:, None] + torch.cat([torch.zeros_like(st.pos)[:, None], tree.depth], 1)
    start = st.cache.length
    logits, fused = parts.forward(ids, pos, block_mask(st.cache.valid, ancestor_mask(tree)), st.cache, hidden=eagle)
    if opts["temperature"] <= 0:
        path, n_acc, bonus = accept_greedy(logits, tree)
    elif q is not None:
        path, n_acc, bonus = accept_chain_sampled(logits, tree, q, parts.drafter.draft_to_target_ids(),
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
    count = outs.emit(st, emitted, token_logprobs(path_logits, emitted), n_acc + 1, parts.eos)
    if eagle:
        _queue_drafter_inputs(st, emitted, fused.gather(1, path[..., None].expand(bsz, m, fused.shape[-1])), keep)
    st.pos = st.pos + n_acc + 1
    st.last = bonus
    if tree.conf is not None and parts.draft_stop_below > 0:
        parts.calibrator.update(tree.conf, tree.valid, n_acc)
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
