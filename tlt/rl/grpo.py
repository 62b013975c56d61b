"""GRPO / DAPO advantages and losses as pure tensor functions.

References:
- GRPO: Shao et al. 2024, "DeepSeekMath" (group-normalised advantages, no critic).
- DAPO: Yu et al. 2025 (clip-higher: asymmetric clip range; token-level loss mean over the
  whole batch; dynamic sampling = dropping groups whose rewards all agree).
- k3 KL: J. Schulman, "Approximating KL divergence" (2020): k3 = r - 1 - log r, r = p/q,
  unbiased for KL(q || p) with samples from q, always >= 0, low variance.

Every reduction over tokens takes an optional `denom`: the number of response tokens in the
*whole* batch. Micro-batches that pass the same `denom` produce losses (and statistics) that sum
to exactly the full-batch token mean, which is what gradient accumulation needs.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Log-ratio clamp before exp() in the k3 estimator: keeps exp() finite when the policy and the
# reference disagree wildly on a token (exp(20) ~ 5e8, still representable in fp16/bf16 math).
_LOG_RATIO_CLAMP = 20.0


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of `x` where `mask` is set. x, mask: same shape (mask bool or 0/1) -> scalar."""
    return (x * mask.to(x.dtype)).sum()


def masked_mean(x: Tensor, mask: Tensor, denom: float | Tensor | None = None) -> Tensor:
    """Mean of `x` over the set entries of `mask` -> scalar.

    x, mask: same shape. `denom` overrides the count (e.g. the full batch's token count when
    x is one micro-batch). An empty mask gives 0, not NaN.
    """
    if denom is None:
        denom = mask.to(x.dtype).sum()
    if isinstance(denom, Tensor):
        denom = denom.to(x.dtype).clamp(min=1.0)
    else:
        denom = max(float(denom), 1.0)
    return masked_sum(x, mask) / denom


def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """group_ids [N] (any ints) -> (inverse [N] in 0..G-1, counts [G], G)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts, int(counts.numel())


def group_advantages(rewards: Tensor, group_ids: Tensor, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024, eq. for outcome supervision).

    rewards [N] float, group_ids [N] long (rows sharing an id answered the same prompt)
    -> advantages [N] = (r - mean_group) / (std_group + eps) when `scale`, else r - mean_group.

    std is the unbiased (n-1) sample std, as in the reference implementations; a group of one
    sample has advantage 0 (std taken as 0, so the row is a no-op either way).
    """
    r = rewards.to(torch.float32)
    inverse, counts, n_groups = _group_index(group_ids)
    sums = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, r)
    mean = sums / counts.to(r.dtype)
    centred = r - mean[inverse]
    if not scale:
        return centred
    sq = torch.zeros_like(mean).index_add_(0, inverse, centred * centred)
    std = torch.sqrt(sq / (counts.to(r.dtype) - 1).clamp(min=1.0))
    return centred / (std[inverse] + eps)


def zero_std_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Rows whose group's rewards all agree (no GRPO signal; DAPO dynamic sampling drops them).

    rewards [N], group_ids [N] -> bool [N].
    """
    inverse, _, n_groups = _group_index(group_ids)
    r = rewards.to(torch.float32)
    hi = torch.full((n_groups,), -torch.inf, device=r.device).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full((n_groups,), torch.inf, device=r.device).scatter_reduce(0, inverse, r, "amin")
    return (hi == lo)[inverse]


def policy_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, clip_low: float,
                clip_high: float, denom: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate with clip-higher (DAPO) and a token-level batch mean.

    logp, old_logp [B,T] log-probs of the sampled tokens under the current / rollout policy,
    adv [B] sequence advantages, mask [B,T] response tokens.
    ratio = exp(logp - old_logp); per token: -min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A),
    averaged over all masked tokens of the batch (not per sequence first: DAPO sec. 3.3).

    Returns (loss scalar, stats) with stats (detached scalars, token means with the same denom):
    - clip_ratio: share of tokens where the clipped term was the active one,
    - approx_kl: k3 estimate of KL(old || new) (samples come from the old policy).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    a = adv.to(logp.dtype).unsqueeze(-1)  # [B,1], broadcast over tokens
    surr = ratio * a
    surr_clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * a
    loss = masked_mean(-torch.minimum(surr, surr_clipped), mask, denom)
    with torch.no_grad():
        clipped = (surr_clipped < surr).to(logp.dtype)
        stats = {"clip_ratio": masked_mean(clipped, mask, denom),
                 "approx_kl": kl_k3(old_logp, logp, mask, denom)}
    return loss, stats


def kl_k3(logp: Tensor, ref_logp: Tensor, mask: Tensor, denom: float | Tensor | None = None) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) on tokens sampled from pi -> scalar.

    logp, ref_logp, mask [B,T]. Per token: exp(ref - logp) - (ref - logp) - 1 (>= 0),
    masked token mean. Differentiable w.r.t. logp (the GRPO KL penalty, Shao et al. 2024 eq. 4).
    """
    d = torch.clamp(ref_logp - logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return masked_mean(torch.exp(d) - d - 1.0, mask, denom)


def entropy_from_logits(logits: Tensor, chunk: int = 1024) -> Tensor:
    """Entropy of softmax(logits) per position: logits [B,T,V] -> [B,T] (fp32).

    H = logsumexp(z) - sum(softmax(z) * z). Computed over chunks of T so that only one
    [B,chunk,V] fp32 temporary is alive at a time (the vocabulary dominates memory).
    """
    out = []
    for start in range(0, logits.shape[1], chunk):
        # -inf logits (masked vocabulary) would give 0 * -inf = NaN; the finite minimum gives 0.
        z = logits[:, start:start + chunk].float().clamp(min=torch.finfo(torch.float32).min)
        lse = torch.logsumexp(z, dim=-1)
        out.append(lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1))
    if not out:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)
    return torch.cat(out, dim=1)
