"""Stage 3: the drafter's warm-start on the target's self-distilled corpus (tlt.corpus,
tlt.distill), or, when retraining, the registry's champion drafter (tlt.retrain)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from tlt import retrain as retraining
from tlt.corpus import Corpus, build_corpus
from tlt.drafter.train import DrafterTrainer
from tlt.summaries import WarmstartSummary
from tlt.distill import fingerprint
from tlt.distill import warmstart as warmstart_drafter
from tlt.rollout.acceptance import heldout_accept
from tlt.rollout.breakeven import NO_BOUND, rate_of

if TYPE_CHECKING:
    from tlt.build import RunParts


def corpus(parts: RunParts, dataset) -> Corpus:
    """The drafter's self-distilled warm-start corpus (tlt.corpus), logged as a dataset input."""
    cfg = parts.cfg
    c = build_corpus(parts.engine, parts.encode, cfg, dataset.train["prompt"].tolist(),
                     dataset.heldout["prompt"].tolist(), Path(cfg.model.cache_dir).parent / "corpora",
                     fingerprint(parts.model, []), capture=parts.drafter.aux_layer_ids)
    parts.tracker.log_dataset(c.frame(), name="drafter-corpus", digest=c.key, source=str(c.path),
                              tags={"tokens": c.n_tokens, "sequences": len(c)})
    parts.tracker.log_metrics({"warmstart/corpus_tokens": c.n_tokens, "warmstart/corpus_sequences": len(c),
                               "timing_s/corpus": c.build_s}, step=0)
    return c


def warmstart(parts: RunParts, heldout_prompts: list[list[int]], built: Corpus) -> tuple[WarmstartSummary, DrafterTrainer]:
    """Train the drafter in place on `built` (a corpus); returns the summary and its trainer."""
    cfg, tracker = parts.cfg, parts.tracker
    summary, trainer = warmstart_drafter(parts.model, parts.drafter, parts.engine, built, heldout_prompts, cfg,
                                         Path(cfg.model.cache_dir).parent / "drafters", log=tracker.log_metrics)
    tracker.log_metrics({"warmstart/accept_len_before": summary.accept_len_before,
                         "warmstart/accept_len_after": summary.accept_len_after,
                         "warmstart/accept_len_sampled": summary.accept_len_sampled or 0.0,
                         "warmstart/vocab_coverage": summary.vocab_coverage or 0.0,
                         "warmstart/train_tokens": summary.n_tokens, "timing_s/warmstart": summary.time_s}, step=0)
    return summary, trainer


def champion_drafter(parts: RunParts, heldout_prompts: list[list[int]]) -> tuple[WarmstartSummary, DrafterTrainer]:
    """Retrain: the registry's champion drafter instead of a warm-start, its held-out accept length."""
    t0 = time.perf_counter()
    cfg, drafter = parts.cfg, parts.drafter
    local = retraining.load_champion_drafter(drafter, parts.champion, cfg, parts.run_dir / "champion")
    trainer = DrafterTrainer(drafter, cfg.drafter, parts.model.get_output_embeddings().weight)
    acc = heldout_accept(parts.engine, heldout_prompts, cfg, 0.0).accept_len
    sampled = heldout_accept(parts.engine, heldout_prompts, cfg, cfg.rollout.temperature or 1.0).accept_len
    return WarmstartSummary(accept_len_before=acc, accept_len_after=acc, accept_len_sampled=sampled, n_samples=0,
                            n_tokens=0, train_steps=0, time_s=time.perf_counter() - t0, cached=True,
                            path=str(local)), trainer


def accept_prior(cfg, greedy: float | None, sampled: float | None) -> float | None:
    """The per-token acceptance the rollout's bandit is priced at (tlt.rollout.breakeven.rate_of): of the
    held-out accept length at the rollout temperature (`sampled`; `greedy` for a greedy rollout), as the
    warm-start and every evaluation measure it with the fixed `drafter.eval_strategy` chain; None when
    that was not measured."""
    accept = greedy if cfg.rollout.temperature == 0 else sampled
    depth = cfg.drafter.eval_strategy.depth
    return rate_of(accept, depth) if accept is not None and depth >= 1 else None


def price_prior(engine, rate: float | None, tracker, step: int = 0) -> int | None:
    """Give `engine` (the run's, or the RL steps' pool) the drafter's measured acceptance `rate`: its
    bandit's prior and its `auto` tail threshold follow (tlt.rollout.breakeven.reprice). Logs
    spec/prior_accept_rate, spec/tail_threshold and what the curve took to measure (timing_s/calibration); returns that threshold (None: the engine has no
    cost curve, e.g. rollout.tuner_calibrate false, and nothing moved)."""
    if rate is None:
        return None
    curve = engine.set_accept_prior(rate)
    if curve is None:
        return None
    threshold = int(curve["tail_threshold"])
    tracker.log_metrics({"spec/prior_accept_rate": rate, "spec/tail_threshold": float(threshold),
                         "timing_s/calibration": float(curve.get("seconds", 0.0))}, step=step)
    return threshold


def prior_line(rate: float | None, threshold: int | None) -> str:
    """After the warm-start: where the rollout will speculate, priced from this machine's cost curve at the
    drafter's measured acceptance (tlt.rollout.breakeven); '' when no curve was measured."""
    if rate is None or threshold is None:
        return ""
    where = ("off (it cannot pay on this machine at this acceptance; priced again at each evaluation)"
             if threshold == 0 else "at every batch size" if threshold >= NO_BOUND
             else f"while <= {threshold} sequences decode")
    return (f"speculation priced from this machine's cost curve at the drafter's held-out acceptance "
            f"{rate:.2f} per draft: SD {where}")
