"""Teacher-forced accept length: what a drafter would accept on fixed greedy responses, without
running speculative decoding (no bandit, no timing, one target forward per sequence). An offline
estimate of the held-out accept length (tlt.rollout.acceptance.heldout_accept, which decodes through the
engine) for benchmarks that compare many drafters; neither is the live rollout counter
spec/accept_len/mean.

Given a sequence x = prompt + greedy response and the target's hidden states from one forward
over it, the drafter is unrolled `depth` steps with the training-time-test masks
(`tlt.drafter.train.ttt_mask`). Step k at position p sees the step-0 keys at q <= p-k and the
step-j keys at q = p-(k-j), i.e. exactly the depth-4 chain the engine drafts from the round
whose root (newest token) is x_{p-k+1}: its KV cache holds the teacher-forced inputs
(fuse(aux_q), x_{q+1}) for q <= root-1 (`spec._queue_drafter_inputs`) and the chain's own steps.
Step k feeds the *true* token x_{p+1} where the engine feeds its draft; both are equal on
the accepted prefix, and nothing after the first rejection is counted.

Per root i (response index; position n = P + i) the greedy accept length is
a_i = 1 + (number of leading drafts k = 0.. with argmax(step k at n-1+k) == x_{n+1+k}).
`simulate_rounds` replays the engine's rounds (root 0 = the prefill's token, next root i + a_i,
each round emits min(a_i, R - i - 1) tokens), so tokens / passes is what `measure_accept`
reports at greedy for a chain of the same depth (equal up to float rounding of the features:
the engine's come from incremental verify forwards, these from one full forward).

First-draft acceptance at temperature T (sampled drafts, `accept_chain_sampled`): sum_x min(p, q)
= 1 - TV(p, q), p = softmax(target logits / T), q = softmax(drafter step-0 logits / T) over the
draft vocabulary, averaged over roots (contexts are the greedy responses).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from tlt.drafter.train import Sample, ttt_mask


@dataclass
class AcceptEval:
    """Per sequence: tokens and passes of the replayed SD rounds, per-root accept lengths, and the
    first-draft acceptance at temperature (sum and count over roots)."""
    tokens: np.ndarray                 # [N] tokens emitted by speculative rounds
    passes: np.ndarray                 # [N] target verify passes
    root_accept: list[np.ndarray] = field(default_factory=list)  # per sequence a_i
    first_sum: np.ndarray | None = None  # [N] sum over roots of sum_x min(p, q)
    first_count: np.ndarray | None = None  # [N] roots

    @property
    def accept_len(self) -> float:
        return float(self.tokens.sum() / max(self.passes.sum(), 1))

    @property
    def accept_pos(self) -> float:
        """Mean accept length over every response position (not only the replayed roots)."""
        a = np.concatenate([r for r in self.root_accept if len(r)] or [np.zeros(0)])
        return float(a.mean()) if len(a) else 1.0

    @property
    def first_accept(self) -> float:
        return float(self.first_sum.sum() / max(self.first_count.sum(), 1)) if self.first_sum is not None else 0.0


def root_accepts(match: np.ndarray) -> np.ndarray:
    """match [depth, R-1] bool (draft k of root i correct, False where x_{i+1+k} is past the end)
    -> a_i = 1 + leading correct drafts, [R-1]."""
    return 1 + np.cumprod(match, axis=0).sum(axis=0)


def simulate_rounds(a: np.ndarray, n_resp: int) -> tuple[int, int]:
    """Replay the engine's rounds over a response of n_resp tokens with per-root accept lengths
    a [n_resp-1]: the prefill emits token 0, a round at root i emits min(a_i, n_resp-i-1) tokens
    (`Outputs.emit` stops at EOS / max_new) and the next root is i + a_i. Returns (tokens, passes)."""
    i = tokens = passes = 0
    while i + 1 < n_resp:
        step = int(a[i])
        tokens += min(step, n_resp - i - 1)
        passes += 1
        i += step
    return tokens, passes


def _pad(samples: list[Sample], dev) -> dict[str, Tensor]:
    """Right-padded batch: inputs shifted as the drafter sees them (token_{t+1} at t)."""
    L = max(s["input_ids"].shape[0] for s in samples)
    B = len(samples)
    A, H = samples[0]["aux"].shape[1], samples[0]["target_hidden"].shape[1]
    out = {"ids": torch.zeros(B, L, dtype=torch.long), "next": torch.zeros(B, L, dtype=torch.long),
           "seq_ids": torch.full((B, L), -1, dtype=torch.long), "aux": torch.zeros(B, L, A),
           "target_hidden": torch.zeros(B, L, H)}
    for b, s in enumerate(samples):
        T = s["input_ids"].shape[0]
        out["ids"][b, :T] = s["input_ids"]
        out["next"][b, :T - 1] = s["input_ids"][1:]
        out["seq_ids"][b, :T] = 0
        out["aux"][b, :T] = s["aux"].float()
        out["target_hidden"][b, :T] = s["target_hidden"].float()
    return {k: v.to(dev) for k, v in out.items()}


@torch.no_grad()
def chain_predictions(drafter, samples: list[Sample], depth: int) -> tuple[Tensor, Tensor]:
    """Teacher-forced chain drafts: (preds [depth,B,L] target ids predicted for x_{p+2} by step k at
    position p, step-0 logits [B,L,Vd]) over right-padded samples."""
    dev = drafter.fc.weight.device
    b = _pad(samples, dev)
    pos = torch.arange(b["ids"].shape[1], device=dev).expand_as(b["ids"])
    hidden, past, preds, first = drafter.fuse(b["aux"]), None, [], None
    for k in range(depth):
        h, logits, past = drafter(b["next"], hidden, pos, past=past, key_mask=ttt_mask(b["seq_ids"], k))
        preds.append(drafter.to_target_ids(logits.argmax(-1)))
        if k == 0:
            first = logits
        hidden = torch.roll(h, 1, dims=1)  # step k+1 at p continues from step k at p-1
    return torch.stack(preds), first


@torch.no_grad()
def evaluate_drafter(drafter, samples: list[Sample], prompt_lens: list[int], depth: int = 4,
                     temperature: float = 0.0, lm_head_weight: Tensor | None = None,
                     batch_size: int = 16) -> AcceptEval:
    """Teacher-forced accept lengths of `drafter` on samples (from `collect_samples` over prompt +
    greedy response; prompt_lens [N]). With temperature > 0 and the target's lm_head weight [V,H],
    also the first-draft acceptance sum min(p, q) at that temperature."""
    was_training = drafter.training
    drafter.eval()
    toks, passes, roots, fsum, fcnt = [], [], [], [], []
    draft_ids = drafter.draft_to_target_ids()
    try:
        for s0 in range(0, len(samples), batch_size):
            chunk = samples[s0:s0 + batch_size]
            preds, first = chain_predictions(drafter, chunk, depth)
            for j, s in enumerate(chunk):
                x, P = s["input_ids"], prompt_lens[s0 + j]
                R = x.shape[0] - P
                match = np.zeros((depth, max(R - 1, 0)), dtype=bool)
                for k in range(depth):  # root i: draft k at position P+i-1+k vs x[P+i+1+k]
                    n = R - 1 - k  # roots with a true token for draft k
                    if n > 0:
                        match[k, :n] = (preds[k, j, P - 1 + k:P - 1 + k + n].cpu() == x[P + 1 + k:P + 1 + k + n]).numpy()
                a = root_accepts(match) if R > 1 else np.zeros(0, dtype=np.int64)
                t, p = simulate_rounds(a, R)
                toks.append(t)
                passes.append(p)
                roots.append(a)
                if temperature > 0 and lm_head_weight is not None and R > 1:
                    th = s["target_hidden"][P:P + R - 1].float().to(lm_head_weight.device)
                    logits = drafter.target_logits(th @ lm_head_weight.float().T)  # the target's own scaling
                    p_t = torch.softmax(logits / temperature, -1)[:, draft_ids]
                    q = torch.softmax(first[j, P - 1:P - 1 + R - 1].float() / temperature, -1)
                    fsum.append(float(torch.minimum(p_t, q.to(p_t.device)).sum()))
                    fcnt.append(R - 1)
                else:
                    fsum.append(0.0)
                    fcnt.append(0)
    finally:
        drafter.train(was_training)
    return AcceptEval(np.asarray(toks), np.asarray(passes), roots, np.asarray(fsum), np.asarray(fcnt))


def accept_ratio_ci(a: AcceptEval, b: AcceptEval, n_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> list[float]:
    """Paired bootstrap CI of accept_len(a) / accept_len(b), two evaluations on the same sequences:
    sequences resampled with replacement, pairs kept together (accept = sum tokens / sum passes)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a.tokens), size=(n_boot, len(a.tokens)))
    ra = a.tokens[idx].sum(1) / np.maximum(a.passes[idx].sum(1), 1)
    rb = b.tokens[idx].sum(1) / np.maximum(b.passes[idx].sum(1), 1)
    ratio = ra / np.maximum(rb, 1e-9)
    lo = (1 - level) / 2
    return [float(np.quantile(ratio, lo)), float(np.quantile(ratio, 1 - lo))]
