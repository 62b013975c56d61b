"""The vLLM rollout backend against the torch engine: one generate, and the cost of a weight sync.

    python bench/vllm_rollout.py conf/default.yaml --json out.json [--reps 2] [--set k=v ...]

Same target, prompts (the recipe's first training prompts, chat template) and sampling options
for both engines, no speculation (the drafter would need a warm-start; acceptance is checked by
tests/test_vllm_backend.py). Rows: the RL rollout (prompts_per_step x group_size at the recipe's
temperature) and greedy over the same prompts, each engine's best of `reps` runs interleaved
A B A B (the machine is shared); the vLLM engine's start; a sync after changing one MLP weight
(in-place reload) and after changing the embedding (for a tied model: a rebuild). Also checks
that greedy outputs are identical (fp32).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tlt.config import load_config
from tlt.data import load_dataset, prompt_ids
from tlt.models import eos_token_ids, load_target
from tlt.rollout import RolloutEngine
from tlt.rollout.vllm_backend import VllmRolloutEngine


def _best(engines: dict, reps: int, **kw) -> dict:
    """Best wall time and tokens/s per engine over `reps` interleaved runs."""
    best: dict = {}
    for _ in range(reps):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            out = eng.generate(**kw)
            dt = time.perf_counter() - t0
            tokens = sum(map(len, out.response_ids))
            if name not in best or dt < best[name]["s"]:
                best[name] = {"s": round(dt, 3), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1),
                              "outputs": out.response_ids}
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides + ["rollout.spec=false", "model.dtype=float32"])
    r = cfg.rollout
    model, tok = load_target(cfg.model)
    eos = eos_token_ids(tok, model)
    d = cfg.data
    ds = load_dataset(d, tok)
    prompts = [prompt_ids(tok, p, d.instruction, d.system_prompt) for p in ds.train["prompt"][: r.prompts_per_step]]
    t0 = time.perf_counter()
    vllm = VllmRolloutEngine.for_run(model, tok, cfg, eos, None, Path("runs") / "bench-vllm")
    res = {"vllm_start_s": round(time.perf_counter() - t0, 2), "versions": vllm.versions,
           "torch_threads": torch.get_num_threads(), "prompts": len(prompts), "group_size": r.group_size,
           "max_new_tokens": r.max_new_tokens, "temperature": r.temperature}
    engines = {"torch": RolloutEngine(model, r, eos, tok.pad_token_id), "vllm": vllm}
    vllm.generate(prompts[:1], max_new_tokens=4)  # the first vLLM call warms its kernels up
    try:
        rl = _best(engines, args.reps, prompts=prompts, group_size=r.group_size, temperature=r.temperature, seed=1)
        greedy = _best(engines, args.reps, prompts=prompts, temperature=0.0)
        res["greedy_identical"] = greedy["torch"]["outputs"] == greedy["vllm"]["outputs"]
        for name, rows in (("rollout", rl), ("greedy", greedy)):
            res[name] = {k: {x: v for x, v in row.items() if x != "outputs"} for k, row in rows.items()}
            res[name]["vllm_speedup"] = round(rows["torch"]["s"] / rows["vllm"]["s"], 2)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(1.001)
        res["sync_layer"] = vllm.sync()
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(1.001)
        res["sync_embedding"] = vllm.sync()
        res["tied_embeddings"] = bool(model.config.tie_word_embeddings)
    finally:
        vllm.close()
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
