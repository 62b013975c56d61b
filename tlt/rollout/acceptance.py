"""The one definition of an accept length: tokens emitted per target verify pass with the tuner
off and one fixed, named strategy, measured through any engine's `fixed_strategy` block (torch or
vLLM alike). Every reported accept length (warm-start, evaluation, export, benchmarks) comes from
here; the live rollout counter `spec/accept_len/mean` (whatever the tuner picked) is not one of them,
and tlt.drafter.accept_eval is a teacher-forced estimate of the same figure without an engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from tlt.config import SpecStrategy
from tlt.rollout.contract import Engine


@dataclass
class AcceptReport:
    """Accept length of a fixed strategy: tokens emitted per target verify pass (prefill excluded)."""

    accept_len: float
    tokens: int
    passes: int
    responses: list[list[int]]


def measure_accept(engine: Engine, prompts: list[list[int]], temperature: float = 0.0,
                   max_new_tokens: int = 48, strategy: SpecStrategy | None = None,
                   batch_size: int = 8) -> AcceptReport:
    """Accept length with the tuner OFF and one fixed, named strategy (default: a depth-4 chain).

    Every round of every prompt is a speculative round of `strategy` (threshold >= batch, no
    patience, no confidence pruning, no spec guard), so the number depends on the drafter and the prompts only,
    not on what a bandit happened to pick or learn. Prompts run `batch_size` at a time (the
    per-row accept length does not depend on the batch). Runs inside `engine.fixed_strategy`, which
    leaves the engine as it was (an n-gram strategy sees no earlier answers of the prompts); an
    engine that cannot run it raises `EngineCapabilityError` with the reason.
    `responses` are the outputs (greedy SD is lossless: the target's own).
    """
    strategy = strategy or SpecStrategy(depth=4, topk=1, tokens=4)
    if strategy.plain:
        raise ValueError("measure_accept needs a drafting strategy (depth >= 1), not the plain arm")
    tokens = passes = 0
    responses: list[list[int]] = []
    with engine.fixed_strategy(strategy, batch_size):
        for i in range(0, len(prompts), batch_size):
            out = engine.generate(prompts[i:i + batch_size], max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=i, spec=True)
            tokens += out.stats.spec_tokens
            passes += out.stats.spec_row_passes
            responses += [list(r) for r in out.response_ids]
    return AcceptReport(tokens / max(passes, 1), int(tokens), int(passes), responses)


def accept_length(engine: Engine, prompts: list[list[int]], temperature: float = 0.0,
                  max_new_tokens: int = 48, strategy: SpecStrategy | None = None, batch_size: int = 8) -> float:
    """`measure_accept(...).accept_len`: mean tokens per verify pass, tuner off, fixed strategy."""
    return measure_accept(engine, prompts, temperature, max_new_tokens, strategy, batch_size).accept_len


def heldout_accept(engine: Engine, heldout_prompts: list[list[int]], cfg, temperature: float) -> AcceptReport:
    """The run's reported accept length ("held-out accept length"): the engine decodes the first
    `drafter.warmstart_eval_prompts` held-out prompts with the tuner off and the fixed
    `drafter.eval_strategy` chain, `drafter.eval_max_new_tokens` each (measure_accept, in the
    engine's `fixed_strategy` block), so the figure depends on the drafter only. It is what
    warmstart/accept_len_*, eval/accept_len* and a registered drafter's accept_len tag hold; the live rollout counter
    spec/accept_len/mean (whatever strategy the tuner picked, at the rollout's batch sizes) is not it."""
    d = cfg.drafter
    return measure_accept(engine, heldout_prompts[: d.warmstart_eval_prompts], temperature=temperature,
                          max_new_tokens=d.eval_max_new_tokens, strategy=d.eval_strategy)


def heldout_accept_lens(engine: Engine, heldout_prompts: list[list[int]], cfg) -> tuple[float, float]:
    """`heldout_accept` greedy and at the rollout temperature: the pair evaluation and export log
    (eval/accept_len, eval/accept_len_sampled)."""
    return (heldout_accept(engine, heldout_prompts, cfg, 0.0).accept_len,
            heldout_accept(engine, heldout_prompts, cfg, cfg.rollout.temperature or 1.0).accept_len)
