"""Warm-start the drafter on the target's own responses before RL (TLT: drafter section).

Responses come from the target (one greedy and one sampled at the rollout temperature per
prompt, so the drafter sees both regimes it will draft for); one batched target forward over
prompt + response gives the hidden states and the next-token distributions it learns from.
The result is cached by a hash of (target weights, prompts, drafter and rollout config).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, pack
from tlt.rollout.engine import accept_length
from tlt.summaries import WarmstartSummary


# The inputs a warm-start reads: runs that differ only elsewhere (spot, refresh, SD) share a cache entry.
_DRAFTER_KEYS = {"variant", "draft_vocab_size", "aux_layer_ids", "lr", "weight_decay", "grad_clip",
                 "loss_feature_weight", "loss_token_weight", "ttt_steps", "feature_target", "train_on_prompt",
                 "warmstart_prompts", "warmstart_max_new_tokens", "warmstart_epochs", "batch_tokens"}


def cache_key(model, prompts: list[list[int]], cfg) -> str:
    inputs = {"drafter": cfg.drafter.model_dump(include=_DRAFTER_KEYS), "temperature": cfg.rollout.temperature,
              "top_p": cfg.rollout.top_p, "seed": cfg.rl.seed, "eval_max_new_tokens": cfg.eval.max_new_tokens}
    return fingerprint(model, prompts, json.dumps(inputs, sort_keys=True))


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


def _responses(engine, prompts, cfg) -> tuple[list[list[int]], list[int]]:
    seqs, plens = [], []
    for temp in (0.0, cfg.rollout.temperature or 1.0):
        out = engine.generate(prompts, max_new_tokens=cfg.drafter.warmstart_max_new_tokens, temperature=temp,
                              top_p=cfg.rollout.top_p, seed=cfg.rl.seed, spec=False)
        seqs += [list(p) + list(r) for p, r in zip(out.prompt_ids, out.response_ids)]
        plens += [len(p) for p in out.prompt_ids]
    return seqs, plens


def _accept(engine, prompts, cfg, temperature) -> float:
    return accept_length(engine, prompts, temperature=temperature, max_new_tokens=cfg.eval.max_new_tokens)


def warmstart(model, drafter, engine, train_prompts: list[list[int]], heldout_prompts: list[list[int]],
              cfg, cache_root: Path, log=lambda metrics, step: None) -> tuple[WarmstartSummary, DrafterTrainer]:
    """Train `drafter` in place on target responses; returns the summary and the trainer (optimizer state)."""
    t0 = time.perf_counter()
    prompts = train_prompts[: cfg.drafter.warmstart_prompts]
    evalp = heldout_prompts[: cfg.drafter.warmstart_eval_prompts]
    head = model.get_output_embeddings().weight
    key = cache_key(model, prompts, cfg)
    cache = Path(cache_root) / key
    if (cache / "summary.json").exists():
        drafter.load_state_dict(load_file(cache / "drafter.safetensors"), strict=True)
        summary = WarmstartSummary.model_validate_json((cache / "summary.json").read_text())
        summary = summary.model_copy(update={"cached": True, "time_s": time.perf_counter() - t0})
        trainer = DrafterTrainer(drafter, cfg.drafter, head)
        if (cache / "optimizer.pt").exists():  # same optimizer state as on a miss
            trainer.opt.load_state_dict(torch.load(cache / "optimizer.pt", weights_only=True))
        return summary, trainer
    before = _accept(engine, evalp, cfg, 0.0)
    seqs, plens = _responses(engine, prompts, cfg)
    if cfg.drafter.train_on_prompt:  # every position after the first is a training position
        plens = [1] * len(seqs)
    samples = collect_samples(model, seqs, plens, drafter.aux_layer_ids)
    if drafter.draft_vocab_size < drafter.vocab_size:
        drafter.set_vocab(count_tokens(samples, drafter.vocab_size))
    trainer = DrafterTrainer(drafter, cfg.drafter, head)
    step = 0
    for epoch in tqdm(range(cfg.drafter.warmstart_epochs), desc="drafter warm-start", unit="epoch"):
        for batch in pack(samples, cfg.drafter.batch_tokens, shuffle_seed=cfg.rl.seed + epoch):
            log({f"warmstart/{k.split('/', 1)[1]}": v for k, v in trainer.step(batch).items()}, step)
            step += 1
    summary = WarmstartSummary(
        accept_len_before=before, accept_len_after=_accept(engine, evalp, cfg, 0.0),
        accept_len_after_t1=_accept(engine, evalp, cfg, 1.0), n_samples=len(samples),
        n_tokens=int(sum(int(s["loss_mask"].sum()) for s in samples)), train_steps=step,
        time_s=time.perf_counter() - t0, path=str(cache))
    cache.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in drafter.trainable_state_dict().items()}, cache / "drafter.safetensors")
    torch.save(trainer.opt.state_dict(), cache / "optimizer.pt")
    (cache / "summary.json").write_text(summary.model_dump_json(indent=2))  # written last: marks it complete
    return summary, trainer
