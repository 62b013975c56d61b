"""Stage 3: the drafter's warm-start on the target's self-distilled corpus (tlt.corpus,
tlt.warmstart), or, when retraining, the registry's champion drafter (tlt.retrain)."""
from __future__ import annotations

import time
from pathlib import Path

from tlt import retrain as retraining
from tlt.config import RunConfig
from tlt.corpus import Corpus, build_corpus
from tlt.drafter.train import DrafterTrainer
from tlt.summaries import WarmstartSummary
from tlt.warmstart import fingerprint, heldout_accept
from tlt.warmstart import warmstart as warmstart_drafter


def corpus(cfg: RunConfig, engine, model, drafter, dataset, encode, tracker) -> Corpus:
    """The drafter's self-distilled warm-start corpus (tlt.corpus), logged as a dataset input."""
    c = build_corpus(engine, encode, cfg, dataset.train["prompt"].tolist(), dataset.heldout["prompt"].tolist(),
                     Path(cfg.model.cache_dir).parent / "corpora", fingerprint(model, []),
                     capture=drafter.aux_layer_ids)
    tracker.log_dataset(c.frame(), name="drafter-corpus", digest=c.key, source=str(c.path),
                        tags={"tokens": c.n_tokens, "sequences": len(c)})
    tracker.log_metrics({"warmstart/corpus_tokens": c.n_tokens, "warmstart/corpus_sequences": len(c),
                         "timing_s/corpus": c.build_s}, step=0)
    return c


def warmstart(cfg: RunConfig, engine, model, drafter, heldout_prompts: list[list[int]], built: Corpus,
              tracker) -> tuple[WarmstartSummary, DrafterTrainer]:
    """Train the drafter in place on `built` (a corpus); returns the summary and its trainer."""
    summary, trainer = warmstart_drafter(model, drafter, engine, built, heldout_prompts, cfg,
                                         Path(cfg.model.cache_dir).parent / "drafters", log=tracker.log_metrics)
    tracker.log_metrics({"warmstart/accept_len_before": summary.accept_len_before,
                         "warmstart/accept_len_after": summary.accept_len_after,
                         "warmstart/accept_len_sampled": summary.accept_len_sampled or 0.0,
                         "warmstart/vocab_coverage": summary.vocab_coverage or 0.0,
                         "warmstart/train_tokens": summary.n_tokens, "timing_s/warmstart": summary.time_s}, step=0)
    return summary, trainer


def champion_drafter(cfg: RunConfig, engine, model, drafter, champion: dict, heldout_prompts: list[list[int]],
                     run_dir: Path) -> tuple[WarmstartSummary, DrafterTrainer]:
    """Retrain: the registry's champion drafter instead of a warm-start, its held-out accept length."""
    t0 = time.perf_counter()
    local = retraining.load_champion_drafter(drafter, champion, cfg, run_dir / "champion")
    trainer = DrafterTrainer(drafter, cfg.drafter, model.get_output_embeddings().weight)
    acc = heldout_accept(engine, heldout_prompts, cfg, 0.0).accept_len
    return WarmstartSummary(accept_len_before=acc, accept_len_after=acc, n_samples=0, n_tokens=0, train_steps=0,
                            time_s=time.perf_counter() - t0, cached=True, path=str(local)), trainer
