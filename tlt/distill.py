"""Warm-start the drafter on the target's self-distilled corpus before RL (TLT: drafter section).

The corpus (tlt.corpus) holds the target's own greedy and rollout-temperature answers
to fresh task prompts; one batched target forward over prompt + response gives the hidden
states and next-token distributions the drafter learns from (EAGLE-3 loss, training-time test,
warmup + cosine LR). The draft vocabulary is the corpus' most frequent response tokens. The
result is cached by a hash of (target weights, corpus, drafter config). Accept lengths are the
held-out accept length (`heldout_accept`: tuner off, the fixed `drafter.eval_strategy`).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from tlt.corpus import Corpus, vocab_coverage
from tlt.drafter.train import (DrafterTrainer, Sample, collect_samples, count_batches, pack, prompt_weight,
                               weight_prompt)
from tlt.rollout.acceptance import heldout_accept
from tlt.versions import write_weights
from tlt.summaries import WarmstartSummary


# The inputs a warm-start reads: runs that differ only elsewhere (spot, refresh, SD) share a cache entry.
_DRAFTER_KEYS = {"draft_vocab_size", "aux_layer_ids", "init_from_target", "lr", "weight_decay", "grad_clip",
                 "loss_feature_weight", "loss_token_weight", "ttt_steps", "ttt_decay", "feature_target",
                 "train_on_prompt", "prompt_loss_weight", "warmstart_epochs", "warmup_ratio", "min_lr_ratio",
                 "batch_tokens", "warmstart_eval_prompts", "eval_max_new_tokens", "eval_strategy", "precision"}


def cache_key(model, corpus_key: str, cfg) -> str:
    inputs = {"drafter": cfg.drafter.model_dump(include=_DRAFTER_KEYS), "corpus": corpus_key,
              "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p, "seed": cfg.rl.seed, "version": 2}
    return fingerprint(model, [], json.dumps(inputs, sort_keys=True))


def fingerprint(model, prompts: list[list[int]], *texts: str) -> str:
    """Hash of the target's weights (a strided sample of every tensor), the prompts and texts."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        h.update(name.encode())
        h.update(flat[:: max(1, flat.numel() // 64)].float().numpy().tobytes())
    h.update(json.dumps(prompts).encode())
    for t in texts:
        h.update(t.encode())
    return h.hexdigest()[:16]


def corpus_samples(model, corpus: Corpus, aux_ids: list[int], cfg, batch: int = 128) -> list[Sample]:
    """Target features of every corpus sequence: those captured while it was generated, else one
    batched no-grad forward per 16 sequences.

    Response tokens weigh 1; with `train_on_prompt` prompt tokens weigh `prompt_loss_weight`.
    """
    d = cfg.drafter
    seqs = [p + r for p, r in zip(corpus.prompt_ids, corpus.response_ids)]
    plens = [len(p) for p in corpus.prompt_ids]
    out: list[Sample] = []
    if corpus.features is not None:
        out = [{"input_ids": torch.tensor(s, dtype=torch.long), "aux": a, "target_hidden": f,
                "loss_mask": torch.arange(len(s)) >= n} for s, n, (a, f) in zip(seqs, plens, corpus.features)]
    else:
        for i in tqdm(range(0, len(seqs), batch), desc="drafter features", unit="chunk"):
            out += collect_samples(model, seqs[i:i + batch], plens[i:i + batch], aux_ids, batch_size=16)
    return [weight_prompt(s, prompt_weight(d)) for s in out]


def response_counts(corpus: Corpus, vocab_size: int) -> torch.Tensor:
    """[V] counts of the corpus' response tokens (the draft vocabulary is built from these)."""
    toks = torch.tensor([t for r in corpus.response_ids for t in r], dtype=torch.long)
    return torch.bincount(toks, minlength=vocab_size)[:vocab_size]


def _restore(drafter, cache: Path, cfg, head, t0: float) -> tuple[WarmstartSummary, DrafterTrainer]:
    write_weights(drafter, load_file(cache / "drafter.safetensors"))
    summary = WarmstartSummary.model_validate_json((cache / "summary.json").read_text())
    summary = summary.model_copy(update={"cached": True, "time_s": time.perf_counter() - t0})
    trainer = DrafterTrainer(drafter, cfg.drafter, head)
    if (cache / "optimizer.pt").exists():  # same optimizer state as on a miss
        trainer.opt.load_state_dict(torch.load(cache / "optimizer.pt", weights_only=True))
    trainer.constant_lr()
    return summary, trainer


def warmstart(model, drafter, engine, corpus: Corpus, heldout_prompts: list[list[int]],
              cfg, cache_root: Path, log=lambda metrics, step: None) -> tuple[WarmstartSummary, DrafterTrainer]:
    """Train `drafter` in place on the corpus; returns the summary and the trainer (optimizer state)."""
    t0 = time.perf_counter()
    d = cfg.drafter
    evalp = heldout_prompts[: d.warmstart_eval_prompts]
    head = model.get_output_embeddings().weight
    cache = Path(cache_root) / cache_key(model, corpus.key, cfg)
    if (cache / "summary.json").exists():
        return _restore(drafter, cache, cfg, head, t0)
    before = heldout_accept(engine, evalp, cfg, 0.0).accept_len
    if drafter.draft_vocab_size < drafter.vocab_size:
        drafter.set_vocab(response_counts(corpus, drafter.vocab_size))
    samples = corpus_samples(model, corpus, drafter.aux_layer_ids, cfg)
    trainer = DrafterTrainer(drafter, d, head)
    n_batches = count_batches(samples, d.batch_tokens)
    trainer.schedule(n_batches * d.warmstart_epochs)
    step = 0
    bar = tqdm(total=n_batches * d.warmstart_epochs, desc="drafter warm-start", unit="step")
    for epoch in range(d.warmstart_epochs):
        for batch in pack(samples, d.batch_tokens, shuffle_seed=cfg.rl.seed + epoch):
            m = trainer.step(batch)
            log({f"warmstart/{k.split('/', 1)[1]}": v for k, v in m.items()}, step)
            bar.set_postfix(loss=f"{m.get('drafter/loss', 0):.3f}", acc=f"{m.get('drafter/top1_acc', 0):.2f}")
            bar.update(1)
            step += 1
    bar.close()
    trainer.constant_lr()
    greedy = heldout_accept(engine, evalp, cfg, 0.0)
    sampled = heldout_accept(engine, evalp, cfg, cfg.rollout.temperature or 1.0)
    summary = WarmstartSummary(
        accept_len_before=before, accept_len_after=greedy.accept_len, accept_len_sampled=sampled.accept_len,
        vocab_coverage=vocab_coverage(drafter.t2d if drafter.draft_vocab_size < drafter.vocab_size else None,
                                      greedy.responses),
        corpus_key=corpus.key, corpus_tokens=corpus.n_tokens, corpus_sequences=len(corpus),
        n_samples=len(samples), n_tokens=corpus.n_tokens,
        train_steps=step, time_s=time.perf_counter() - t0, path=str(cache))
    cache.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, cache / "drafter.safetensors")
    torch.save(trainer.opt.state_dict(), cache / "optimizer.pt")
    (cache / "summary.json").write_text(summary.model_dump_json(indent=2))  # written last: marks it complete
    return summary, trainer
