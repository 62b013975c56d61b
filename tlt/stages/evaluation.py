"""Evaluation: greedy held-out accuracy through the rollout engine and, when the run has a drafter,
its held-out accept length (tlt.rollout.acceptance.heldout_accept), logged at the evaluated step."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import pandas as pd

from tlt.checkpoint import load_checkpoint
from tlt.config import RunConfig
from tlt.rl.resume import steps_done
from tlt.rl.rewards import checked_rewards, get_reward_fn
from tlt.rollout.acceptance import heldout_accept_lens
from tlt.rollout.contract import Engine
from tlt.summaries import EvalSummary
from tlt.versions import write_weights

if TYPE_CHECKING:
    from tlt.build import RunParts


GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


def score_heldout(heldout: pd.DataFrame, prompt_ids: list[list[int]], generate: GenerateFn, decode: Callable,
             reward_fn: Callable, max_new_tokens: int, batch_size: int, step: int = 0
             ) -> tuple[EvalSummary, list[dict]]:
    """Greedy-decode every held-out prompt; a response is correct when its reward is >= 1.

    Returns the summary and one record per prompt (prompt, answer, response, reward) for the
    sample table.
    """
    t0 = time.perf_counter()
    responses: list[list[int]] = []
    for i in range(0, len(prompt_ids), batch_size):
        responses += generate(prompt_ids[i:i + batch_size], max_new_tokens)
    texts = [decode(r) for r in responses]
    rewards = checked_rewards(reward_fn, texts, list(heldout["answer"]), tasks=list(heldout["task"]),
                              metas=list(heldout["meta"]))  # a user function's failure is a RewardError
    records = [{"id": i, "prompt": p, "answer": a, "response": t, "reward": r}
               for i, p, a, t, r in zip(heldout["id"], heldout["prompt"], heldout["answer"], texts, rewards)]
    n = max(len(rewards), 1)
    summary = EvalSummary(step=step, accuracy=sum(r >= 1.0 for r in rewards) / n, n=len(rewards),
                          mean_length=sum(map(len, responses)) / n, time_s=time.perf_counter() - t0)
    return summary, records


def generate_greedy(engine: Engine, cfg: RunConfig, eos_ids: list[int], prompts: list[list[int]],
                    max_new_tokens: int, sd: str = "config") -> list[list[int]]:
    """Greedy responses (token ids, EOS excluded) through the rollout engine. sd: "config" (SD as
    configured), "off", or "always" (speculate on every step, whatever the batch size)."""
    if sd not in ("config", "off", "always"):
        raise ValueError(f"sd must be 'config', 'off' or 'always', not {sd!r}")
    kw = {"spec_threshold": len(prompts)} if sd == "always" else {}
    out = engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                          spec=cfg.rollout.spec if sd == "config" else sd == "always", **kw)
    return [[t for t in r if t not in eos_ids] for r in out.response_ids]


def evaluate(parts: RunParts, heldout: pd.DataFrame, step: int, sd: str = "config", accept: bool = True
             ) -> EvalSummary:
    """Held-out accuracy (greedy, decoding as `generate_greedy(sd=...)`) and, with a drafter (unless
    `accept` is off), the held-out accept length greedy and at the rollout temperature; logged,
    records included."""
    cfg, engine = parts.cfg, parts.engine
    summary, records = score_heldout(
        heldout, parts.encode(heldout["prompt"]),
        lambda p, n: generate_greedy(engine, cfg, parts.eos_ids, p, n, sd),
        lambda ids: parts.tokenizer.decode(ids, skip_special_tokens=True), get_reward_fn(cfg.rl.reward),
        cfg.eval.max_new_tokens, cfg.eval.batch_size, step)
    metrics = {"eval/accuracy": summary.accuracy, "eval/response_length/mean": summary.mean_length,
               "timing_s/eval": summary.time_s}
    if parts.drafter is not None and accept:
        prompts = parts.encode(heldout["prompt"][: cfg.drafter.warmstart_eval_prompts])
        summary.accept_len, summary.accept_len_sampled = heldout_accept_lens(engine, prompts, cfg)
        metrics["eval/accept_len"], metrics["eval/accept_len_sampled"] = summary.accept_len, summary.accept_len_sampled
    parts.tracker.log_metrics(metrics, step=step)
    parts.tracker.log_table(records, f"eval/samples_step_{step:04d}.json")
    summary.records = records
    return summary


def load_weights(model, drafter, checkpoint: str | Path) -> int:
    """Policy (and drafter, when the run has one and the checkpoint holds it) from a run checkpoint,
    for evaluation; returns the step the checkpoint continues at."""
    tensors, state, _ = load_checkpoint(Path(checkpoint))
    write_weights(model, tensors["policy"])
    if "drafter" in tensors and drafter is not None:
        write_weights(drafter, tensors["drafter"])
    return steps_done(state)
