"""One RL step of TLT: rollout (SD in the tail) -> rewards -> GRPO advantages -> policy update,
whose forward also yields the old log-probs and feeds the drafter buffer -> drafter refresh.

The policy lives in this process and the torch engine decodes with the same module, so the
weight sync after an update is free (no copy, no disk); an engine in another process (vLLM)
gets the new weights from its `sync` at the end of the step.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import Tensor

from tlt.device import module_device
from tlt.faults import fault
from tlt.metrics import rollout_metrics
from tlt.precision import autocast
from tlt.rl.grpo import group_advantages, zero_std_groups
from tlt.rl.logprobs import forward_logprobs, make_batch
from tlt.rl.protocols import Refresher, Updater
from tlt.rollout.contract import Engine
from tlt.rl.rewards import checked_rewards
from tlt.rl.update import PolicyBatch, detached, fuses_old_logprob
from tlt.schemas import rollout_table

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tlt.config import RunConfig
    from tlt.rl.sampler import PromptSampler
    from tlt.rollout.batch import RolloutBatch

class Timer:
    """Accumulates wall-clock seconds per named section: `with timer("rollout"): ...`."""

    def __init__(self):
        self.s: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.s.items()}


@dataclass(frozen=True)
class StepContext:
    """What every RL step reads: built once per run (tlt.build), never written by a step."""

    cfg: RunConfig
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    updater: Updater
    sampler: PromptSampler
    reward_fn: Callable
    encode: Callable[[list[str]], list[list[int]]]
    refresher: Refresher | None = None  # None = no drafter training


@dataclass
class StepResult:
    """What one RL step made: its metrics (names as in docs/tracking.md: What a run produces), its
    rollout as one `RolloutSchema` row per response, and the rollout batch (for run-level plots)."""

    metrics: dict[str, float]
    samples: list[dict]
    batch: RolloutBatch


def reward_metrics(rewards: list[float], tasks: list[str], group_ids: list[int]) -> dict[str, float]:
    r = np.asarray(rewards, dtype=float)
    out = {"reward/mean": float(r.mean()), "reward/std": float(r.std())}
    for task in sorted(set(tasks)):
        sel = np.asarray([t == task for t in tasks])
        out[f"reward/{task}/mean"] = float(r[sel].mean())
    zero = zero_std_groups(torch.tensor(r, device="cpu"), torch.tensor(group_ids, device="cpu"))  # metrics only
    out["reward/frac_zero_std"] = float(zero.float().mean())
    return out


def _rollout(ctx: StepContext, step: int, timer: Timer):
    cfg = ctx.cfg
    rows = ctx.sampler.next(cfg.rollout.prompts_per_step)
    on_tail = None
    if ctx.refresher:
        with timer("sync"):
            on_tail = ctx.refresher.before_rollout(step)
    with timer("rollout"):
        fault("rollout", step)
        batch = ctx.engine.generate(ctx.encode(list(rows["prompt"])), group_size=cfg.rollout.group_size,
                                    temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                    seed=cfg.rl.seed * 100_003 + step, spec=cfg.rollout.spec, on_tail=on_tail)
    return rows, batch


def _rewards(ctx: StepContext, rows, batch, timer: Timer):
    g = batch.group_index
    texts = [ctx.tokenizer.decode(r, skip_special_tokens=True) for r in batch.response_ids]
    pick = lambda col: [rows[col].iloc[i] for i in g]  # noqa: E731 - per-sample view of a prompt column
    with timer("reward"):
        rewards = checked_rewards(ctx.reward_fn, texts, pick("answer"), tasks=pick("task"), metas=pick("meta"))
    return texts, rewards, pick("task")


def _drafter_rows(ctx: StepContext, step: int, ids, attn, resp, out) -> None:
    """Hand the drafter buffer the hidden states of one forward over rows of the step's batch
    ([B,T,...]; TLT: its training data comes from a forward the RL step runs anyway, no extra pass)."""
    ctx.refresher.add_rollouts(step, ids, attn, resp, out.aux, out.last_hidden)


def update_order(attn: Tensor, keep: Tensor, by_length: bool) -> Tensor:
    """Rows of the policy update: the kept ones, longest first when `by_length`, so each
    micro-batch holds rows of similar length and is trimmed to little padding (a long-tail
    rollout in rollout order pads most micro-batches to its longest answers). The loss is a
    token sum over the batch, so the order changes the result only by fp32 summation order."""
    idx = torch.nonzero(keep).squeeze(1)
    if by_length:
        idx = idx[attn[idx].sum(1).argsort(descending=True, stable=True)]
    return idx


def padding_share(lengths: Tensor, micro: int) -> float:
    """Share of the update's forward positions that are padding: micro-batches of `micro`
    consecutive rows, each trimmed to its longest row."""
    runs = [lengths[i:i + micro] for i in range(0, len(lengths), micro)]
    total = sum(len(r) * int(r.max()) for r in runs)
    return 1.0 - int(lengths.sum()) / total if total else 0.0


def _update(ctx: StepContext, step: int, tensors, adv: Tensor, keep: Tensor, timer: Timer) -> dict[str, float]:
    """Policy update on the kept rows; the drafter buffer gets every row's hidden states.

    Fused (`fuses_old_logprob`): one forward per sample, the update's own, gives the old
    log-probs and the drafter's features. Otherwise (or for rows the update filters out) a
    no-grad forward first, scored at temperature 1 like the update's, so the first ratio is 1.
    `perf/target_forwards_per_sample` counts the learner's full-sequence policy forwards.
    """
    ids, attn, resp, pos = tensors
    aux_ids = ctx.refresher.aux_layer_ids if ctx.refresher else None
    fused = fuses_old_logprob(ctx.cfg)
    rows = torch.arange(len(ids), device=ids.device)
    separate = rows if not fused else (rows[~keep] if ctx.refresher else rows[:0])
    old_logp = None
    metrics: dict[str, float] = {}
    if len(separate):
        # in the update's precision: the first ratio is 1 to rounding, not to bf16-vs-fp32 noise
        with timer("old_logprob"), torch.no_grad(), autocast(ctx.cfg.trainer.precision, ids.device):
            fo = detached(forward_logprobs(ctx.model, ids[separate], attn[separate], resp[separate],
                                           aux_layer_ids=aux_ids, position_ids=pos[separate]))
        if ctx.refresher:
            _drafter_rows(ctx, step, ids[separate], attn[separate], resp[separate], fo)
        if not fused:
            old_logp = fo.logp

    def on_forward(start, mb, out):  # one micro-batch of the update's forward, detached
        _drafter_rows(ctx, step, mb.input_ids, mb.attention_mask, mb.response_mask, out)

    if not (fused and ctx.refresher):
        on_forward = None
    if keep.any():
        with timer("update_policy"):
            fault("update", step)
            idx = update_order(attn, keep, ctx.cfg.trainer.group_by_length)
            pb = PolicyBatch(input_ids=ids[idx], attention_mask=attn[idx], response_mask=resp[idx],
                             old_logp=None if old_logp is None else old_logp[idx], advantages=adv[idx],
                             position_ids=pos[idx])
            metrics.update(ctx.updater.step(pb, aux_layer_ids=aux_ids if on_forward else None, on_forward=on_forward))
            metrics["perf/update_padding_share"] = padding_share(attn[idx].sum(1), ctx.cfg.trainer.micro_batch_size)
    n = max(len(ids), 1)
    metrics["perf/target_forwards_per_sample"] = (len(separate) + int(keep.sum())) / n
    return metrics


def rl_step(ctx: StepContext, step: int) -> StepResult:
    """Run RL step `step`; returns its metrics, rollout samples and batch."""
    cfg, timer = ctx.cfg, Timer()
    t0 = time.perf_counter()
    rows, batch = _rollout(ctx, step, timer)
    metrics: dict[str, float] = rollout_metrics(batch)
    if ctx.refresher:  # spot trainer: stops within one drafter step, new weights loaded
        with timer("update_drafter"):
            metrics.update(ctx.refresher.after_rollout())
    texts, rewards, tasks = _rewards(ctx, rows, batch, timer)
    dev = module_device(ctx.model)  # the batch, its advantages and its row selections live with the policy
    group_ids = torch.tensor(batch.group_index, device=dev)
    r = torch.tensor(rewards, dtype=torch.float32, device=dev)
    adv = group_advantages(r, group_ids)
    keep = ~zero_std_groups(r, group_ids) if cfg.rl.filter_zero_std else torch.ones_like(adv, dtype=torch.bool)
    ids, attn, resp, pos = make_batch(batch.prompt_ids, batch.response_ids, ctx.tokenizer.pad_token_id, dev)
    metrics.update(ctx.engine.sleep())  # vLLM sleep mode: its GPU memory goes to the update, `sync` wakes it
    metrics.update(_update(ctx, step, (ids, attn, resp, pos), adv, keep, timer))
    if ctx.refresher:  # sequential refresh (when not spot-trained)
        with timer("update_drafter"):
            metrics.update(ctx.refresher.after_update(step, dict(metrics)))
    with timer("sync"):  # an engine outside this process (vLLM, workers) gets the new weights
        metrics.update(ctx.engine.sync(ctx.model))
    metrics.update(reward_metrics(rewards, tasks, batch.group_index))
    metrics.update(timer.metrics())
    metrics["timing_s/step"] = time.perf_counter() - t0
    metrics["perf/tokens_per_s"] = sum(map(len, batch.response_ids)) / max(metrics["timing_s/step"], 1e-9)
    samples = rollout_table(step, rows, batch.group_index, texts, rewards,
                            list(map(len, batch.response_ids))).to_dict("records")
    return StepResult(metrics=metrics, samples=samples, batch=batch)
