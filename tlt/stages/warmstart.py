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
    return WarmstartSummary(accept_len_before=acc, accept_len_after=acc, n_samples=0, n_tokens=0, train_steps=0,
                            time_s=time.perf_counter() - t0, cached=True, path=str(local)), trainer
