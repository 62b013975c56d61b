"""Sampling from the policy and the acceptance rules of speculative decoding (pure tensor functions).

The target distribution is `p = top_p(softmax(logits / T))`, renormalised; greedy (T = 0) is the
argmax of the raw logits. Plain decoding and verification use these same functions, which is
what makes speculative decoding lossless: greedy outputs are identical and sampled outputs follow
`p` (Leviathan et al. 2023; multi-draft recursive rejection as in SpecTr / SpecInfer).
"""
from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution `[..., V]` from raw logits `[..., V]` (temperature > 0, nucleus `top_p`)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens `[B]` from logits `[B, V]`; greedy when temperature == 0 (no softmax computed)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return draw(target_probs(logits, temperature, top_p), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [B, V] -> [B]: argmax(p / E), E ~ Exp(1) (the exponential race,
    exact like multinomial and much faster on CPU for large vocabularies)."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] at temperature 1: logits `[..., V]`, tokens `[...]` -> `[...]` fp32.

    The one formula for a token's log-prob: the rollout's sampled-token log-probs and the RL
    forward (`tlt.rl.logprobs`) both use it, so the two agree bit for bit on equal logits.
    gather − logsumexp: no `[..., V]` log-softmax tensor besides the logits.
    """
    z = logits.float()
    picked = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def reject_siblings(probs: torch.Tensor, cand: torch.Tensor, cand_ok: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection over deterministic (point-mass) draft candidates.

    probs [B, V] target distribution at the current node; cand [B, C] candidate tokens in the
    order they are tried; cand_ok [B, C] which candidates exist. Candidate c is accepted with
    probability r(x_c), r the residual (p with earlier rejected candidates removed, renormalised);
    on rejection r(x_c) := 0. This samples exactly from p: P(out = x) = p(x) for every x.
    Returns (accepted [B] bool, choice [B] index into C (valid where accepted),
    residual [B, V] to sample the bonus from where nothing was accepted).
    """
    res = probs.clone()
    bsz, n_cand = cand.shape
    accepted = torch.zeros(bsz, dtype=torch.bool, device=probs.device)
    choice = torch.zeros(bsz, dtype=torch.long, device=probs.device)
    u = torch.rand(bsz, n_cand, generator=generator, device=probs.device)
    for c in range(n_cand):
        tok = cand[:, c: c + 1]
        r = res.gather(1, tok).squeeze(1) / res.sum(1).clamp_min(1e-30)
        live = cand_ok[:, c] & ~accepted
        take = live & (u[:, c] < r)
        choice = torch.where(take, c, choice)
        accepted |= take
        drop = live & ~take
        res.scatter_(1, tok, torch.where(drop.unsqueeze(1), 0.0, res.gather(1, tok)))
    return accepted, choice, res
