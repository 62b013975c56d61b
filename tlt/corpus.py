"""The drafter's warm-start corpus, self-distilled: the target's own answers to fresh task prompts.

EAGLE-style drafters are trained on the target's *own* outputs (regenerated responses, not the
dataset's), so the drafter learns exactly the distribution it will be verified against. The
prompts come from the recipe's reasoning-gym generators with a different seed (unlimited fresh
prompts of the same tasks; held-out prompts excluded), or, for a user dataset, from its training
split (cycled, later passes sampled only). Each prompt gets one greedy answer (first time it is
seen) and one at the rollout temperature, through the project's batched engine with SD off,
until `drafter.corpus_tokens` response tokens are collected.

The corpus is stored once, content-hashed (target weights, prompts' source, instruction,
sampling, budget), as Parquet under `<cache>/corpora/<key>/corpus.parquet`, and reused by
every run with the same inputs.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import torch
from tqdm.auto import tqdm

from tlt.atomic import write_file
from tlt.prompts import generate_rows

CORPUS_SEED_OFFSET = 7919  # the corpus' generator seed = data.seed + this (never the training split's seed)


@dataclass
class Corpus:
    """Sequences of the corpus (prompt ids, response ids, sampling temperature), and where it lives."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    temperatures: list[float]
    key: str
    path: Path
    build_s: float = 0.0
    cached: bool = False
    features: list | None = None  # in memory only: (aux, final hidden) per sequence, captured while generating

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_tokens(self) -> int:
        """Response tokens (the budget counts these)."""
        return sum(len(r) for r in self.response_ids)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"prompt_ids": self.prompt_ids, "response_ids": self.response_ids,
                             "temperature": self.temperatures})


def corpus_key(model_fp: str, cfg, source: str) -> str:
    """Content hash of everything the corpus depends on."""
    d = cfg.drafter
    inputs = {"model": model_fp, "source": source, "instruction": cfg.data.instruction,
              "system_prompt": cfg.data.system_prompt, "temperature": cfg.rollout.temperature,
              "top_p": cfg.rollout.top_p, "tokens": d.corpus_tokens, "max_new": d.warmstart_max_new_tokens,
              "seed": cfg.rl.seed, "dtype": cfg.rollout.dtype, "version": 1}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def prompt_source(cfg, train_texts: list[str], exclude: set[str]) -> tuple[str, Callable[[], Iterator[str]]]:
    """(description for the hash, a generator of prompt texts) for the corpus."""
    gens = cfg.data.generators
    if cfg.data.path is None and gens:
        desc = json.dumps({"generators": [g.model_dump() for g in gens], "seed": cfg.data.seed,
                           "exclude": sorted(exclude)}, sort_keys=True)
        return desc, lambda: _generated(gens, cfg.data.seed, exclude)
    digest = hashlib.sha256(json.dumps(train_texts).encode()).hexdigest()
    return json.dumps({"train": digest}), lambda: _cycled(train_texts)


def _generated(gens, seed: int, exclude: set[str]) -> Iterator[str]:
    """Fresh reasoning-gym prompts of the recipe's tasks, round after round (new seed each round)."""
    for round_ in range(1000):
        rows = generate_rows(gens, seed + CORPUS_SEED_OFFSET + 101 * round_)
        texts = [t for t in rows["prompt"].tolist() if t not in exclude]
        if not texts:
            raise ValueError("the corpus generators produce only held-out prompts")
        yield from texts


def _cycled(texts: list[str]) -> Iterator[str]:
    if not texts:
        raise ValueError("no training prompts to build the drafter corpus from")
    while True:
        yield from texts


def build_corpus(engine, encode: Callable[[list[str]], list[list[int]]], cfg, train_texts: list[str],
                 heldout_texts: list[str], root: Path, model_fp: str, capture: list[int] | None = None) -> Corpus:
    """Generate (or load) the corpus; see the module doc. `capture` (a drafter's aux ids): keep the
    target features the generating forwards computed (`Corpus.features`), so training needs no
    second forward over the corpus (a corpus loaded from the cache has none)."""
    d = cfg.drafter
    source, texts = prompt_source(cfg, train_texts, set(heldout_texts))
    key = corpus_key(model_fp, cfg, source)
    path = Path(root) / key / "corpus.parquet"
    t0 = time.perf_counter()
    if path.exists():
        df = pd.read_parquet(path)
        return Corpus([list(map(int, x)) for x in df["prompt_ids"]], [list(map(int, x)) for x in df["response_ids"]],
                      [float(x) for x in df["temperature"]], key, path, time.perf_counter() - t0, cached=True)

    # Engines that capture (the in-process torch engine) record features; others (vLLM, workers):
    # warm-start re-forwards.
    extra = {"capture": capture} if capture is not None and engine.capabilities.capture else {}
    prompts, responses, temps, feats = [], [], [], []
    seen: set[str] = set()
    stream = texts()
    temp = cfg.rollout.temperature or 1.0
    n, chunk = 0, d.corpus_prompts_per_batch
    bar = tqdm(total=d.corpus_tokens, desc="drafter corpus", unit="tok")
    while n < d.corpus_tokens:
        # Size the batch to the budget left (2 answers per fresh prompt, length as seen so far).
        per_seq = n / len(prompts) if prompts else d.warmstart_max_new_tokens / 2
        batch = [next(stream) for _ in range(max(1, min(chunk, math.ceil((d.corpus_tokens - n) / (2 * per_seq)))))]
        fresh = [t for t in dict.fromkeys(batch) if t not in seen]
        seen.update(fresh)
        for texts_, t in ((fresh, 0.0), (batch, temp)):
            if not texts_ or n >= d.corpus_tokens:
                continue
            ids = encode(texts_)
            out = engine.generate(ids, max_new_tokens=d.warmstart_max_new_tokens, temperature=t,
                                  top_p=cfg.rollout.top_p, seed=cfg.rl.seed + len(prompts), spec=False, **extra)
            feats += out.features or []
            for p, r in zip(out.prompt_ids, out.response_ids):
                prompts.append(list(p))
                responses.append(list(r))
                temps.append(t)
                n += len(r)
                bar.update(len(r))
    bar.close()
    corpus = Corpus(prompts, responses, temps, key, path, time.perf_counter() - t0,
                    features=feats if extra else None)
    write_file(path, corpus.frame().to_parquet)  # atomic: a killed build leaves no half corpus
    return corpus


def vocab_coverage(t2d, token_lists: list[list[int]]) -> float:
    """Share of the tokens in `token_lists` (e.g. the target's greedy answers) inside the draft vocabulary."""
    toks = [t for ts in token_lists for t in ts]
    if not toks:
        return 0.0
    if t2d is None:  # full vocabulary
        return 1.0
    ids = torch.tensor(toks, dtype=torch.long)
    return float(t2d[ids].float().mean())
