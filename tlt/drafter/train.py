"""Drafter training: packed batches, the TLT loss, EAGLE-3 training-time test, warm-start data.

A *sample* is one sequence as the target saw it (nothing shifted):
    input_ids [T] long, aux [T,3H_t] (cat of the target's hidden_states at aux ids),
    target_hidden [T,H] (hidden_states[-1], i.e. after the target's final norm), loss_mask [T]
    bool (True on response tokens), optionally loss_weight [T] float (the weight of the position
    whose token it is; default loss_mask: 1 on trained tokens, 0 elsewhere).
Drafter position t sees fuse(aux_t) and token_{t+1} and predicts token_{t+2}, whose target
distribution is softmax(lm_head(target_hidden_{t+1})) -- recomputed here from the stored
hidden, never by another target forward. Position t is trained iff token_{t+2} is a response
token (so the drafter learns exactly the distributions the rollout drafts against), with the
weight of token_{t+2} (prompt tokens can be kept at a lower weight).

Loss (EAGLE-3 as practised, SpecForge): soft cross-entropy against the target's distribution over
`ttt_steps` unrolled draft steps (training-time test), step k weighted ttt_decay**k; the feature
regression below is off by default (`loss_feature_weight: 0`, EAGLE-3 dropped it).

Feature loss (documented choice, `DrafterConfig.feature_target`):
  * "fused" (default): SmoothL1(h_t, stopgrad(fuse(aux_{t+1}))). h_t is fed back as the next
    draft step's hidden *in place of* fuse(aux_{t+1}), so this teaches h exactly the quantity it
    replaces; it makes multi-step drafting work even without TTT. stopgrad keeps fc from
    shrinking its output to zero to make the loss trivial.
  * "final": SmoothL1(norm(h_t), target_hidden_{t+1}) -- TLT/EAGLE-1 style: the drafter's
    norm + lm_head then mirror the target's norm + lm_head.
"""
from __future__ import annotations

import copy
import math
import random

import torch
import torch.nn.functional as F
from torch import Tensor

from tlt.drafter.model import Eagle3Drafter
from tlt.precision import autocast
from tlt.versions import bump, write_weights

Sample = dict[str, Tensor]


def prompt_weight(cfg) -> float:
    """Loss weight of a prompt position under drafter config `cfg` (0 = response tokens only)."""
    return cfg.prompt_loss_weight if cfg.train_on_prompt else 0.0


def weight_prompt(sample: Sample, prompt_weight: float) -> Sample:
    """`sample` (loss_mask True on response tokens) with its prompt positions trained too, at
    `prompt_weight` relative to a response token (a new dict; 0 leaves the sample as it is)."""
    if prompt_weight <= 0:
        return sample
    resp = sample["loss_mask"].bool()
    return {**sample, "loss_weight": torch.where(resp, 1.0, prompt_weight),
            "loss_mask": torch.arange(resp.shape[0], device=resp.device) >= 1}


# ---- packing -----------------------------------------------------------------------------------
def _shift(sample: Sample) -> dict[str, Tensor]:
    """Per-position training fields of one sample (length T, zero/False past the ends)."""
    ids, mask, th = sample["input_ids"], sample["loss_mask"].bool(), sample["target_hidden"]
    T = ids.shape[0]
    w = sample["loss_weight"].float() * mask if "loss_weight" in sample else mask.float()
    return {
        "loss_weight": torch.cat([w[2:], w.new_zeros(min(2, T))])[:T],
        "input_ids": torch.cat([ids[1:], ids.new_zeros(1)]),                      # token_{t+1}
        "aux": sample["aux"],                                                      # aux_t
        "target_hidden": torch.cat([th[1:], th.new_zeros(1, th.shape[1])]),        # target_hidden_{t+1}
        "loss_mask": torch.cat([mask[2:], mask.new_zeros(min(2, T))])[:T],         # token_{t+2} is response
        "position_ids": torch.arange(T, device=ids.device),
    }


def _collate(rows: list[list[Sample]]) -> dict[str, Tensor]:
    """Rows of samples -> one padded batch with seq_ids (-1 on padding) for block-diagonal masks."""
    L = max(sum(s["input_ids"].shape[0] for s in row) for row in rows)
    fields = [_shift(s) for row in rows for s in row]
    A, H = fields[0]["aux"].shape[1], fields[0]["target_hidden"].shape[1]
    B = len(rows)
    out = {"input_ids": torch.zeros(B, L, dtype=torch.long), "position_ids": torch.zeros(B, L, dtype=torch.long),
           "seq_ids": torch.full((B, L), -1, dtype=torch.long), "loss_mask": torch.zeros(B, L, dtype=torch.bool),
           "aux": torch.zeros(B, L, A), "target_hidden": torch.zeros(B, L, H), "loss_weight": torch.zeros(B, L)}
    i = 0
    for b, row in enumerate(rows):
        start = 0
        for j, _ in enumerate(row):
            f, i = fields[i], i + 1
            T = f["input_ids"].shape[0]
            for k in ("input_ids", "position_ids", "loss_mask", "loss_weight"):
                out[k][b, start:start + T] = f[k]
            out["aux"][b, start:start + T] = f["aux"].float()
            out["target_hidden"][b, start:start + T] = f["target_hidden"].float()
            out["seq_ids"][b, start:start + T] = j
            start += T
    return out


ROW_TOKENS = 256  # packed row capacity: attention is dense per row, so short rows cost less


def _rows(samples: list[Sample], batch_tokens: int, row_tokens: int) -> tuple[list[list[Sample]], int]:
    """First-fit-decreasing rows of samples and how many rows make a batch."""
    lengths = [s["input_ids"].shape[0] for s in samples]
    cap = max(max(lengths), min(batch_tokens, row_tokens))
    rows: list[list[Sample]] = []
    room: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(cap)
            slot = len(rows) - 1
        rows[slot].append(samples[i])
        room[slot] -= lengths[i]
    return rows, max(1, batch_tokens // cap)


def count_batches(samples: list[Sample], batch_tokens: int, row_tokens: int = ROW_TOKENS) -> int:
    """len(pack(samples, batch_tokens)) without collating any batch (for LR schedules, progress bars)."""
    if not samples:
        return 0
    rows, per_batch = _rows(samples, batch_tokens, row_tokens)
    return math.ceil(len(rows) / per_batch)


def pack(samples: list[Sample], batch_tokens: int, shuffle_seed: int | None = None,
         row_tokens: int = ROW_TOKENS) -> list[dict[str, Tensor]]:
    """Pack samples into rows (first-fit decreasing), rows into batches of ~batch_tokens tokens.

    Row capacity is max(longest sample, min(batch_tokens, row_tokens)): attention (and the
    training-time test's (k+1)L keys) is dense per row, so rows are kept short and stacked. Each
    batch: input_ids/position_ids/seq_ids/loss_mask [B,L], aux [B,L,3H_t], target_hidden [B,L,H]
    (already shifted, see `_shift`).
    """
    if not samples:
        return []
    rows, per_batch = _rows(samples, batch_tokens, row_tokens)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(rows)
    return [_collate(rows[i:i + per_batch]) for i in range(0, len(rows), per_batch)]


# ---- masks for the training-time test ------------------------------------------------------
def ttt_mask(seq_ids: Tensor, step: int) -> Tensor:
    """[B,L,(step+1)L] bool: which keys the step-`step` query at row index p may attend to.

    Key blocks are the cached keys of steps 0..step (concatenated). Drafting step k from the
    last verified position t = p-k sees step-0 keys at q <= t and the step-j key at
    q = p-(k-j) for j >= 1 (EAGLE-3 training-time test), all within the same packed sample.
    """
    L = seq_ids.shape[1]
    same = (seq_ids.unsqueeze(2) == seq_ids.unsqueeze(1)) & (seq_ids >= 0).unsqueeze(2)
    pos = torch.arange(L, device=seq_ids.device)
    diff = pos.unsqueeze(1) - pos.unsqueeze(0)  # p - q
    blocks = [same & (diff >= step)]
    blocks += [same & (diff == step - j) for j in range(1, step + 1)]
    return torch.cat(blocks, dim=2)


# ---- the trainer ----------------------------------------------------------------------------
def refresh_lr(cfg) -> float:
    """The constant LR of online refreshes: `cfg.refresh_lr`, else where the warm-start's cosine ends."""
    return cfg.refresh_lr if cfg.refresh_lr is not None else cfg.lr * cfg.min_lr_ratio


class DrafterTrainer:
    """AdamW(0.9, 0.95) on the drafter's trainable weights; the shared embedding is excluded.
    `cfg.precision` bf16-mixed: fp32 weights and optimizer, bf16 autocast forward (tlt.precision)."""

    def __init__(self, drafter: Eagle3Drafter, cfg, lm_head_weight: Tensor):
        self.drafter, self.cfg = drafter, cfg
        self.lm_head_weight = lm_head_weight.detach()  # [V,H] target head, frozen
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=refresh_lr(cfg), betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.num_steps = 0
        self._schedule: tuple[int, int, int] | None = None  # (first step, warmup steps, total steps)

    def schedule(self, total_steps: int) -> None:
        """Linear warmup (`cfg.warmup_ratio`) then cosine decay to `cfg.min_lr_ratio` * lr over the
        next `total_steps` optimizer steps (the warm-start); `constant_lr()` ends it."""
        self._schedule = (self.num_steps, int(round(self.cfg.warmup_ratio * total_steps)), max(1, total_steps))

    def constant_lr(self) -> None:
        """Back to the constant refresh LR (online refreshes; `refresh_lr`)."""
        self._schedule = None
        self._set_lr(refresh_lr(self.cfg))

    def lr_now(self) -> float:
        if self._schedule is None:
            return refresh_lr(self.cfg)
        first, warm, total = self._schedule
        i = self.num_steps - first
        if i < warm:
            return self.cfg.lr * (i + 1) / (warm + 1)
        frac = min(1.0, (i - warm) / max(1, total - warm))
        lo = self.cfg.min_lr_ratio
        return self.cfg.lr * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * frac)))

    def _set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def _targets(self, target_hidden: Tensor) -> tuple[Tensor, Tensor]:
        """target_hidden [N,H] -> (probs over the draft vocab [N,Vd] renormalised, target argmax [N]).

        The argmax is taken within the draft vocabulary: a full-vocabulary argmax would cost more
        than the drafter's own forward and backward (49152 x 576 per token on SmolLM2) for a metric.
        """
        head = self.lm_head_weight.to(target_hidden.device)
        draft_ids = self.drafter.draft_to_target_ids()
        with torch.no_grad():
            th = target_hidden.to(head.dtype)
            probs = torch.softmax(self.drafter.target_logits((th @ head[draft_ids].T).float()), dim=-1)
            argmax = draft_ids[probs.argmax(-1)]
        return probs, argmax

    def _step_loss(self, h: Tensor, logits: Tensor, feat_target: Tensor, probs: Tensor,
                   argmax: Tensor, sel: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Losses of one unroll step on the N positions sel [B,L]; probs [N,Vd], argmax [N] and
        weight [N] are theirs (token loss and top-1 accuracy are weighted means)."""
        if self.cfg.feature_target == "final":
            pred = self.drafter.norm(h[sel])
        else:
            pred = h[sel]
        loss_f = F.smooth_l1_loss(pred.float(), feat_target.float())
        logp = torch.log_softmax(logits[sel].float(), dim=-1)
        wsum = weight.sum().clamp_min(1e-9)
        loss_t = (-(probs * logp).sum(-1) * weight).sum() / wsum
        acc = ((self.drafter.to_target_ids(logits[sel].argmax(-1)) == argmax).float() * weight).sum() / wsum
        return loss_f, loss_t, acc, sel.sum()

    def compute_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        """Unroll `cfg.ttt_steps` draft steps over a packed batch; per-step losses weighted ttt_decay**k."""
        d = self.drafter
        dev = d.fc.weight.device
        b = {k: v.to(dev) for k, v in batch.items()}
        pos = b["position_ids"]
        wpos = b["loss_weight"] if "loss_weight" in b else b["loss_mask"].float()
        mask = b["loss_mask"] & (wpos > 0)
        fused = d.fuse(b["aux"])  # [B,L,H]
        next_fused = torch.roll(fused, -1, dims=1).detach()  # fuse(aux_{t+1}); valid where mask
        # Target distributions are the same for every unroll step: compute them once.
        all_probs, all_argmax = self._targets(b["target_hidden"][mask])
        hidden, past, metrics, total, wsum = fused, None, {}, 0.0, 0.0
        all_w = wpos[mask]
        for k in range(self.cfg.ttt_steps):
            key_mask = ttt_mask(b["seq_ids"], k)
            h, logits, cache = d(b["input_ids"], hidden, pos, past=past, key_mask=key_mask)
            sel = mask & (pos >= k)  # step k starts from verified position p-k, in the same sample
            if not sel.any():
                break
            keep = (pos >= k)[mask]  # the step-k subset of the masked positions
            probs, argmax = all_probs[keep], all_argmax[keep]
            feat = b["target_hidden"][sel] if self.cfg.feature_target == "final" else next_fused[sel]
            loss_f, loss_t, acc, n = self._step_loss(h, logits, feat, probs, argmax, sel, all_w[keep])
            wk = self.cfg.ttt_decay ** k
            total = total + wk * (self.cfg.loss_feature_weight * loss_f + self.cfg.loss_token_weight * loss_t)
            wsum += wk
            if k == 0:
                metrics.update({"drafter/loss_feature": loss_f.item(), "drafter/loss_token": loss_t.item(),
                                "drafter/top1_acc": acc.item(), "drafter/tokens": float(n)})
            metrics[f"drafter/top1_acc_step{k}"] = acc.item()
            # Next step: h from position p-1 becomes the hidden at p; keys of all steps so far stay.
            hidden = torch.roll(h, 1, dims=1)
            past = cache
        loss = total / wsum if wsum else total
        metrics["drafter/loss"] = float(loss.detach()) if torch.is_tensor(loss) else 0.0
        return loss, metrics

    def step(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """One optimizer step on a packed batch; returns drafter/* metrics."""
        self.drafter.train()
        with autocast(self.cfg.precision, self.drafter.fc.weight.device):  # fp32 weights; bf16 matmuls if mixed
            loss, metrics = self.compute_loss(batch)
        if not torch.is_tensor(loss) or not loss.requires_grad:
            return metrics  # no response positions in this batch
        self.opt.zero_grad(set_to_none=True)
        if self._schedule is not None:
            self._set_lr(self.lr_now())
            metrics["drafter/lr"] = self.opt.param_groups[0]["lr"]
        loss.backward()
        metrics["drafter/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        self.opt.step()
        bump(self.drafter)  # new drafter weights: the rollout engines sync by this version
        self.num_steps += 1
        return metrics

    def state_dict(self) -> dict:
        """Selective checkpoint: trainable weights (+ vocab maps) and optimizer, no embedding."""
        return {"drafter": {k: v.detach().clone() for k, v in self.drafter.state_dict().items()},
                # deepcopy: Adam's moments are updated in place by later steps (async checkpoints).
                "optimizer": copy.deepcopy(self.opt.state_dict()), "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        write_weights(self.drafter, state["drafter"])
        self.opt.load_state_dict(state["optimizer"])
        self.num_steps = int(state.get("num_steps", 0))


def fit(trainer: DrafterTrainer, samples: list[Sample], epochs: int, batch_tokens: int,
        seed: int = 0) -> list[dict[str, float]]:
    """`epochs` passes over `samples` (repacked and shuffled each epoch) under the warm-start LR
    schedule (warmup + cosine from `lr`), then back to the refresh LR; metrics per step."""
    history = []
    trainer.schedule(count_batches(samples, batch_tokens) * epochs)
    for epoch in range(epochs):
        for batch in pack(samples, batch_tokens, shuffle_seed=seed + epoch):
            history.append(trainer.step(batch))
    trainer.constant_lr()
    return history


# ---- warm-start data ----------------------------------------------------------------------
@torch.no_grad()
def collect_samples(target_model, sequences: list[list[int]], prompt_lens: list[int], aux_ids: list[int],
                    batch_size: int = 8) -> list[Sample]:
    """One target forward per batch (right-padded, output_hidden_states) -> samples on CPU.

    aux/target_hidden are returned in float32; loss_mask is True on positions >= prompt_len.
    """
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
    dev = next(target_model.parameters()).device
    out: list[Sample] = []
    for i in range(0, len(sequences), batch_size):
        seqs = sequences[i:i + batch_size]
        L = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        attn = torch.zeros(len(seqs), L, dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
            attn[j, :len(s)] = 1
        # logits_to_keep=1: the LM head runs on one position only; the drafter needs hidden states.
        hs = target_model(input_ids=ids.to(dev), attention_mask=attn.to(dev), output_hidden_states=True,
                          logits_to_keep=1).hidden_states
        aux = Eagle3Drafter.gather_aux(hs, aux_ids).float().cpu()
        last = hs[-1].float().cpu()
        for j, s in enumerate(seqs):
            T = len(s)
            out.append({"input_ids": ids[j, :T].clone(), "aux": aux[j, :T].clone(),
                        "target_hidden": last[j, :T].clone(),
                        "loss_mask": torch.arange(T) >= prompt_lens[i + j]})
    return out


def count_tokens(samples: list[Sample], vocab_size: int) -> Tensor:
    """[V] counts of response tokens (input to `Eagle3Drafter.set_vocab`)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()], minlength=vocab_size)
    return counts
