"""The comparison arms of bench/adaptive.py, each a drafter built beside the pipeline's own
(adaptive) one without touching it: *frozen* (a copy of the warm-started drafter), *control* (the
refresher code on a copy, fed warm-start corpus instead of fresh rollouts) and *oracle* (a copy of
the final adaptive drafter trained on the final policy's own rollouts); and `rollout_samples`, the
policy's responses with their recorded features, which the oracle trains on and the benchmark
evaluates every arm on."""
from __future__ import annotations

import copy

import numpy as np
import torch


@torch.no_grad()
def rollout_samples(pipe, prompts: list[list[int]], temperature: float, seed: int = 0, max_new: int | None = None,
                    batch: int = 16):
    """The policy's responses (EOS kept, as the engine emits them; chunk i of `batch` prompts
    sampled with seed `seed + i`) and drafter samples over prompt + response whose target features
    were recorded by the decoding forwards (no second forward; the never-fed last token gets zeros,
    which no draft of these responses reads)."""
    responses, samples = [], []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        out = pipe.engine.generate(chunk, max_new_tokens=max_new, temperature=temperature, seed=seed + i, spec=False,
                                   capture=pipe.drafter.aux_layer_ids)
        for p, r, (aux, fin) in zip(chunk, out.response_ids, out.features):
            responses.append(list(r))
            samples.append({"input_ids": torch.tensor(p + list(r), dtype=torch.long), "aux": aux, "target_hidden": fin,
                            "loss_mask": torch.arange(len(p) + len(r)) >= len(p)})
    return responses, samples


def share_drafter(drafter):
    """A deep copy of the drafter's weights that keeps the *target's* embedding and head shared
    (EAGLE drafters read the current policy's embedding; only the drafter's own weights differ)."""
    keep = {id(drafter.embed_weight): drafter.embed_weight}
    if drafter.target_head is not None:
        keep[id(drafter.target_head)] = drafter.target_head
    return copy.deepcopy(drafter, memo=keep)


def refresher_copy(pipe, seed: int, **updates):
    """A DrafterRefresher over a copy of the pipeline's drafter *and* optimizer state (same step
    count), with a buffer large enough for anything the arm feeds it; `updates` override drafter
    config keys (e.g. refresh_steps)."""
    from tlt.drafter.refresh import DrafterRefresher
    from tlt.drafter.train import DrafterTrainer

    d = pipe.cfg.drafter
    drafter = share_drafter(pipe.drafter)
    trainer = DrafterTrainer(drafter, d, pipe.model.get_output_embeddings().weight)
    trainer.opt.load_state_dict(copy.deepcopy(pipe.refresher.trainer.opt.state_dict()))
    trainer.num_steps = pipe.refresher.trainer.num_steps
    cfg = d.model_copy(update={"buffer_max_tokens": max(d.buffer_max_tokens, 1 << 22), **updates})
    return DrafterRefresher(trainer, cfg, seed=seed)


def control_refresher(pipe, corpus, need_tokens: int):
    """The adaptive arm's refresher code on a copy of the warm-started drafter and optimizer, its
    buffer filled once with warm-start corpus sequences (prompt positions weighted as the online
    buffer weighs them): a seeded random subset of >= `need_tokens` tokens, so a corpus loaded from the cache
    (no captured features) is re-forwarded only as far as the control can train on it."""
    from tlt.warmstart import corpus_samples

    ref = refresher_copy(pipe, pipe.cfg.rl.seed)
    order = np.random.default_rng(pipe.cfg.rl.seed).permutation(len(corpus))
    keep, n = [], 0
    for i in order:
        if n >= need_tokens:
            break
        keep.append(int(i))
        n += len(corpus.prompt_ids[i]) + len(corpus.response_ids[i])
    sub = copy.copy(corpus)
    sub.prompt_ids = [corpus.prompt_ids[i] for i in keep]
    sub.response_ids = [corpus.response_ids[i] for i in keep]
    if corpus.features is not None:
        sub.features = [corpus.features[i] for i in keep]
    for s, p in zip(corpus_samples(pipe.model, sub, ref.trainer.drafter.aux_layer_ids, pipe.cfg), sub.prompt_ids):
        resp = torch.arange(s["input_ids"].shape[0]) >= len(p)
        ref.buffer.add(0, s["input_ids"], s["aux"], s["target_hidden"], resp)
    return ref


def oracle_drafter(pipe, n_prompts: int, n_steps: int, temperature: float):
    """The freshness ceiling (final policy only): a copy of the adaptive drafter and its optimizer
    trained `n_steps` more steps on rollouts of the *final* policy itself -- `n_prompts` training
    prompts (seeded, disjoint from the held-out set) at the rollout temperature and length, their
    features recorded by the decoding forwards. No online refresh can have this data before the
    rollout that produces it, and the step count is the caller's, so the arm bounds what fresh data
    plus more training buy this drafter on this policy."""
    seed = pipe.cfg.rl.seed
    ref = refresher_copy(pipe, seed + 1, refresh_steps=n_steps)
    drafter = ref.trainer.drafter
    train = list(pipe.dataset.train["prompt"])
    pick = np.random.default_rng(seed + 1).permutation(len(train))[:n_prompts]
    prompts = pipe.prompt_ids([train[i] for i in pick])
    for smp in rollout_samples(pipe, prompts, temperature, seed=seed + 1)[1]:
        ref.buffer.add(0, smp["input_ids"], smp["aux"], smp["target_hidden"], smp["loss_mask"])
    m = ref.refresh(0)
    return drafter, {"steps": int(m.get("drafter/steps", 0)), "buffer_tokens": int(m.get("drafter/buffer_tokens", 0)),
                     "train_s": m.get("drafter/train_s", 0.0), "prompts": len(prompts)}
