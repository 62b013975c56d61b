"""Evaluation: greedy held-out accuracy through the rollout engine and, when the run has a drafter,
its held-out accept length (tlt.warmstart.heldout_accept), logged at the evaluated step."""
from __future__ import annotations

from pathlib import Path

from tlt.checkpoint import load_checkpoint
from tlt.config import RunConfig
from tlt.evaluate import evaluate as evaluate_heldout
from tlt.rl.protocols import Engine
from tlt.rl.resume import steps_done
from tlt.rl.rewards import get_reward_fn
from tlt.summaries import EvalSummary
from tlt.versions import bump
from tlt.warmstart import heldout_accept


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


def evaluate(cfg: RunConfig, engine: Engine, tokenizer, heldout, encode, eos_ids: list[int], has_drafter: bool,
             tracker, step: int, sd: str = "config") -> EvalSummary:
    """Held-out accuracy (greedy, decoding as `generate_greedy(sd=...)`) and, with a drafter, the
    held-out accept length greedy and at the rollout temperature; logged, records included."""
    summary, records = evaluate_heldout(
        heldout, encode(heldout["prompt"]), lambda p, n: generate_greedy(engine, cfg, eos_ids, p, n, sd),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True), get_reward_fn(cfg.rl.reward),
        cfg.eval.max_new_tokens, cfg.eval.batch_size, step)
    metrics = {"eval/accuracy": summary.accuracy, "eval/response_length/mean": summary.mean_length,
               "timing_s/eval": summary.time_s}
    if has_drafter:
        summary.accept_len, summary.accept_len_sampled = heldout_accept_lens(cfg, engine, heldout, encode)
        metrics["eval/accept_len"], metrics["eval/accept_len_sampled"] = summary.accept_len, summary.accept_len_sampled
    tracker.log_metrics(metrics, step=step)
    tracker.log_table(records, f"eval/samples_step_{step:04d}.json")
    summary.records = records
    return summary


def heldout_accept_lens(cfg: RunConfig, engine: Engine, heldout, encode) -> tuple[float, float]:
    """The drafter's held-out accept length (tlt.warmstart.heldout_accept), greedy and at the
    rollout temperature: the figures eval/accept_len and eval/accept_len_sampled log."""
    prompts = encode(heldout["prompt"][: cfg.drafter.warmstart_eval_prompts])
    return (heldout_accept(engine, prompts, cfg, 0.0).accept_len,
            heldout_accept(engine, prompts, cfg, cfg.rollout.temperature or 1.0).accept_len)


def load_weights(model, drafter, checkpoint: str | Path) -> int:
    """Policy (and drafter, when the run has one and the checkpoint holds it) from a run checkpoint,
    for evaluation; returns the step the checkpoint continues at."""
    tensors, state, _ = load_checkpoint(Path(checkpoint))
    model.load_state_dict(tensors["policy"], strict=True)
    if "drafter" in tensors and drafter is not None:
        drafter.load_state_dict(tensors["drafter"], strict=True)
    for module in (model, drafter):
        bump(module)  # the engines sync by version
    return steps_done(state)
