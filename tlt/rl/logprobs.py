"""The one policy forward of an RL step: token log-probs (+ entropy) and the drafter's hidden states.

TLT (Hu et al. 2026, sec. 4) never recomputes hidden states for the drafter: the forward that
computes the old log-probs also returns the target hidden states at the drafter's aux layers.

Batch layout (right padding, built by `make_batch`), one row per (prompt, response) pair:

    input_ids       p0 p1 p2 r0 r1 r2 r3 PAD PAD
    attention_mask   1  1  1  1  1  1  1   0   0
    response_mask    0  0  0  1  1  1  1   0   0
    position_ids     0  1  2  3  4  5  6   0   0

Position t of `logp` holds log p(input_ids[t] | input_ids[<t]), i.e. it is aligned with the
token it scores, so `response_mask` selects exactly the sampled tokens. Column 0 has no prefix
and is always 0 (a prompt is never empty, so it is never a response token).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tlt.rl.grpo import entropy_from_logits
from tlt.rollout.torch_engine.sampling import token_logprobs


@dataclass
class ForwardOut:
    """Outputs of `forward_logprobs`; all [B,T,...] aligned with input_ids (see module doc)."""

    logp: Tensor  # [B,T] log p(token_t | <t), 0 outside the response
    entropy: Tensor | None = None  # [B,T] entropy of the distribution that produced token_t
    aux: Tensor | None = None  # [B,T,k*H] cat of hidden_states[i] for i in aux_layer_ids
    last_hidden: Tensor | None = None  # [B,T,H] hidden_states[-1] (after the final norm)


def make_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
               device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded batch of prompt+response rows (layout in the module docstring), on `device`
    (filled row by row on the host, then moved in one copy per tensor).

    prompt_ids, response_ids: B lists of token ids (prompts non-empty).
    -> input_ids [B,T] long, attention_mask [B,T] long, response_mask [B,T] bool,
       position_ids [B,T] long (0..len-1 on real tokens, 0 on padding), T = longest row.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"make_batch: {len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("make_batch: every prompt needs at least one token (position 0 has no log-prob)")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    b, t = len(lengths), max(lengths, default=0)
    host = "cpu"
    input_ids = torch.full((b, t), pad_id, dtype=torch.long, device=host)
    attention_mask = torch.zeros((b, t), dtype=torch.long, device=host)
    response_mask = torch.zeros((b, t), dtype=torch.bool, device=host)
    position_ids = torch.zeros((b, t), dtype=torch.long, device=host)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(list(p) + list(r), dtype=torch.long, device=host)
        attention_mask[i, :n] = 1
        response_mask[i, len(p):n] = True
        position_ids[i, :n] = torch.arange(n, device=host)
    return tuple(x.to(device) for x in (input_ids, attention_mask, response_mask, position_ids))


def forward_logprobs(model, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                     aux_layer_ids: list[int] | None = None, temperature: float = 1.0,
                     with_entropy: bool = False, position_ids: Tensor | None = None) -> ForwardOut:
    """One forward of a HF causal LM (or a DeepSpeed engine wrapping one) -> ForwardOut.

    input_ids, attention_mask, response_mask, position_ids: [B,T] (right padding; position_ids
    default to 0..T-1, which is right for right padding). Logits are divided by `temperature`
    (the rollout's sampling temperature, so old log-probs match the sampling distribution).
    Gradients flow unless the caller wraps this in torch.no_grad().
    """
    if temperature <= 0:
        raise ValueError("forward_logprobs: temperature must be > 0 (greedy rollouts score at 1.0)")
    want_hidden = aux_layer_ids is not None
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                output_hidden_states=want_hidden, use_cache=False)
    logits = out.logits[:, :-1].float()  # [B,T-1,V]: position t-1 predicts token t; fp32 under bf16 autocast
    if temperature != 1.0:
        logits = logits / temperature
    mask = response_mask[:, 1:].to(torch.float32)
    logp = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    logp = torch.cat([logp[:, :1], token_logprobs(logits, input_ids[:, 1:]) * mask], dim=1)
    result = ForwardOut(logp=logp)
    if with_entropy:
        ent = entropy_from_logits(logits) * mask
        result.entropy = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
    if want_hidden:
        hs = out.hidden_states  # tuple of L+1 tensors [B,T,H]; 0 = embeddings, -1 = final norm
        result.aux = torch.cat([hs[i] for i in aux_layer_ids], dim=-1)
        result.last_hidden = hs[-1]
    return result
