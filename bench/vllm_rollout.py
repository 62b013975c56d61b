"""The vLLM rollout backend against the torch engine: rollout arms, the tail switch, weight syncs.

    python bench/vllm_rollout.py conf/default.yaml --json out.json [--reps 2] [--fit-epochs 40] [--set k=v ...]

Same target (fp32), prompts (the recipe's first `prompts_per_step` training prompts, chat
template), sampling options and EAGLE-3 drafter for every arm. The drafter is untrained unless
`--fit-epochs N`: then it is fit for N epochs to the target's greedy answers of the NEXT
`--fit-prompts` training prompts (not the measured ones), as a stand-in for the warm-start.
Arms, best of `reps` interleaved runs of the RL rollout (prompts_per_step x group_size at the
recipe's temperature): vLLM plain (`spec=False`), vLLM tail (SD at <= rollout.spec_threshold
running), vLLM always (SD every step), torch plain, torch tail (the recipe's tuner). Greedy over
the same prompts: vLLM plain / tail / always and torch plain must give identical outputs
(`greedy_identical`); the tail run's per-step trace must show drafts only after a step with
<= spec_threshold requests scheduled (`tail_only_drafts`; vLLM applies the K chosen at step t
at t+1); `drafts_static` / `drafts_tail` are vLLM's verify rounds in the always / tail runs.
On vLLM's CPU build sampled calls decode without SD (`vllm_sampled_sd` false; its sampled SD
is not lossless, see tlt/rollout/vllm_backend.py), so there the rollout arms vllm_tail and
vllm_always run plain and only the greedy rows speculate.
Syncs: `sync_s` after one MLP weight and the (tied) embedding changed, `drafter_reload_s` after
the drafter changed (export + in-place reload), `rebuilds` must stay 0.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from tlt.config import load_config
from tlt.data import load_dataset, prompt_ids
from tlt.drafter.model import build_drafter
from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, fit
from tlt.models import eos_token_ids, load_target
from tlt.rollout import RolloutEngine
from tlt.rollout.tuner import StrategyTuner
from tlt.rollout.vllm_backend import VllmRolloutEngine


def _best(arms: dict, reps: int, **kw) -> dict:
    """Best wall time per arm over `reps` interleaved runs; arms: name -> (engine, extra kwargs)."""
    best: dict = {}
    for _ in range(reps):
        for name, (eng, extra) in arms.items():
            t0 = time.perf_counter()
            out = eng.generate(**kw, **extra)
            dt = time.perf_counter() - t0
            if name not in best or dt < best[name]["s"]:
                tokens = sum(map(len, out.response_ids))
                best[name] = {"s": round(dt, 3), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1),
                              "outputs": out.response_ids, "stats": out.stats}
    return best


def _drafter(model, cfg, tok, train_prompts: list[list[int]], epochs: int, eos: list[int]):
    """The recipe's EAGLE-3 drafter; fit to greedy answers of `train_prompts` when epochs > 0."""
    torch.manual_seed(cfg.rl.seed)
    drafter = build_drafter(model, cfg.drafter)
    if epochs > 0:
        plain = RolloutEngine(model, cfg.rollout, eos, tok.pad_token_id)
        out = plain.generate(train_prompts, max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, spec=False)
        seqs = [list(p) + list(r) for p, r in zip(out.prompt_ids, out.response_ids)]
        samples = collect_samples(model, seqs, [len(p) for p in out.prompt_ids], drafter.aux_layer_ids)
        drafter.set_vocab(count_tokens(samples, model.config.vocab_size))
        fit(DrafterTrainer(drafter.train(), cfg.drafter, model.lm_head.weight), samples, epochs, batch_tokens=2048)
    return drafter.eval()


def _greedy_checks(vllm, torch_plain, prompts: list[list[int]], threshold: int) -> dict:
    """Greedy outputs of every vLLM SD mode vs the torch engine's, and where the tail run drafted."""
    vllm.trace = True
    try:
        runs = {"plain": vllm.generate(prompts, temperature=0.0, spec=False),
                "tail": vllm.generate(prompts, temperature=0.0),
                "always": vllm.generate(prompts, temperature=0.0, spec_threshold=len(prompts))}
    finally:
        vllm.trace = False
    ref = torch_plain.generate(prompts, temperature=0.0, spec=False).response_ids
    trace = runs["tail"].stats.vllm["trace"]
    return {"greedy_identical": all(out.response_ids == ref for out in runs.values()),
            "tail_only_drafts": all(trace[i - 1][0] <= threshold for i in range(1, len(trace)) if trace[i][1] > 0)
            and trace[0][1] == 0,
            "drafts_static": runs["always"].stats.vllm["drafts"], "drafts_tail": runs["tail"].stats.vllm["drafts"],
            "drafts_plain": runs["plain"].stats.vllm["drafts"],
            "accept_len_vllm_always": round(runs["always"].stats.accept_len or 1.0, 3)}


def _syncs(vllm, model, drafter) -> dict:
    """Cost of a policy sync (an MLP weight and the embedding changed) and of a drafter reload."""
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.001)
        model.get_input_embeddings().weight.mul_(1.001)
    policy = vllm.sync()
    with torch.no_grad():
        drafter.fc.weight.mul_(1.001)
    reload = vllm.sync()
    return {"sync_s": round(policy["rollout/vllm_sync_s"], 3), "sync_reload_s": round(policy["rollout/vllm_reload_s"], 3),
            "drafter_reload_s": round(reload["rollout/vllm_sync_s"], 3),
            "drafter_reload_worker_s": round(reload["rollout/vllm_reload_s"], 4),
            "tied_embeddings": bool(model.config.tie_word_embeddings)}


def _setup(args):
    cfg = load_config(args.config, args.overrides + ["model.dtype=float32", "rollout.drafter=eagle", "rollout.spec=true"])
    r, d = cfg.rollout, cfg.data
    model, tok = load_target(cfg.model)
    eos = eos_token_ids(tok, model)
    train = load_dataset(d, tok).train["prompt"]
    n = r.prompts_per_step
    prompts = [prompt_ids(tok, p, d.instruction, d.system_prompt) for p in train[: n + args.fit_prompts]]
    drafter = _drafter(model, cfg, tok, prompts[n:], args.fit_epochs, eos)
    return cfg, model, tok, eos, prompts[:n], drafter


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fit-epochs", type=int, default=0)
    ap.add_argument("--fit-prompts", type=int, default=64)
    args = ap.parse_args(argv)
    cfg, model, tok, eos, prompts, drafter = _setup(args)
    r = cfg.rollout
    t0 = time.perf_counter()
    vllm = VllmRolloutEngine.for_run(model, tok, cfg, eos, drafter, Path("runs") / "bench-vllm")
    res = {"vllm_start_s": round(time.perf_counter() - t0, 2), "versions": vllm.versions, "vllm_threads": vllm.threads,
           "torch_threads": torch.get_num_threads(), "prompts": len(prompts), "group_size": r.group_size,
           "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "spec_threshold": r.spec_threshold,
           "depth": r.strategy.depth, "fit_epochs": args.fit_epochs,
           "vllm_sampled_sd": vllm.sampled_sd}  # False: sampled vLLM arms decode without SD (vllm_backend)
    torch_plain = RolloutEngine(model, r, eos, tok.pad_token_id, drafter=drafter)
    tuner = StrategyTuner.from_config(r, seed=cfg.rl.seed) if r.tuner else None
    torch_tail = RolloutEngine(model, r, eos, tok.pad_token_id, drafter=drafter, tuner=tuner)
    try:
        vllm.generate(prompts, temperature=0.0, spec_threshold=len(prompts))  # first calls warm vLLM's kernels up
        res.update(_greedy_checks(vllm, torch_plain, prompts, r.spec_threshold))
        arms = {"vllm_plain": (vllm, {"spec": False}), "vllm_tail": (vllm, {}),
                "vllm_always": (vllm, {"spec_threshold": len(prompts) * r.group_size}),
                "torch_plain": (torch_plain, {"spec": False}), "torch_tail": (torch_tail, {})}
        rl = _best(arms, args.reps, prompts=prompts, group_size=r.group_size, temperature=r.temperature, seed=1)
        for name, row in rl.items():
            res[f"rollout_s_{name}"] = row["s"]
            res[f"tokens_{name}"] = row["tokens"]
            res[f"accept_len_{name}"] = round(row["stats"].accept_len or 1.0, 3)
        res.update(_syncs(vllm, model, drafter))
        res["rebuilds"] = vllm.rebuilds
    finally:
        vllm.close()
    print(json.dumps(res, indent=1))
    return harness.write_result(res, "vllm_rollout", args, argv)


if __name__ == "__main__":
    main()
