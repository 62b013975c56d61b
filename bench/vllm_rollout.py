"""The vLLM rollout backend against the torch engine: rollout arms, the tail switch, weight syncs.

Arms on both engines, same prompts and seed: plain, tail (tlt's tail switch + bandit), always (the
recipe's fixed strategy at every step) and static (the best draft length per tier of a sweep; both
from bench/baselines.py); rollout_s_{engine}_{arm}, speedup_{engine}_vs_{always,static} (the
baseline's rollout over tail's), static_table_{engine}. The K = 0 tax: the SD-built engine with
every tier at K = 0 (`vllm_plain`: SD off, one drafter forward per step still) against an engine
built without SD on the same prompts (`rollout_s_vllm_plain_engine`, `k0_tax` = the first over the
second; `--no-k0-tax` skips the second engine).

    python bench/vllm_rollout.py conf/default.yaml --json out.json [--reps 2] [--fit-epochs 40] [--set k=v ...]
"""
from pathlib import Path

import torch

import harness
from tlt.build import encoder
from tlt.prompts import load_dataset
from tlt.drafter.model import build_drafter
from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, fit
from tlt.models import eos_token_ids, load_target
from tlt.rollout import RolloutEngine, StrategyTuner
from tlt.rollout.vllm_engine.backend import VllmRolloutEngine
from tlt.versions import bump

baselines = harness.load("baselines")


def fitted_drafter(model, cfg, plain, train_prompts: list[list[int]], epochs: int):
    """The recipe's EAGLE-3 drafter; fit to greedy answers of `train_prompts` when epochs > 0."""
    torch.manual_seed(cfg.rl.seed)
    drafter = build_drafter(model, cfg.drafter)
    if epochs > 0:
        out = plain.generate(train_prompts, max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, spec=False)
        samples = collect_samples(model, [list(p) + list(r) for p, r in zip(out.prompt_ids, out.response_ids)],
                                  [len(p) for p in out.prompt_ids], drafter.aux_layer_ids)
        drafter.set_vocab(count_tokens(samples, model.config.vocab_size))
        fit(DrafterTrainer(drafter.train(), cfg.drafter, model.lm_head.weight), samples, epochs, batch_tokens=2048)
    return drafter.eval()


def greedy_checks(vllm, torch_plain, prompts: list[list[int]], threshold: int) -> dict:
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
            "tail_only_drafts": trace[0][1] == 0 and all(trace[i - 1][0] <= threshold
                                                         for i in range(1, len(trace)) if trace[i][1] > 0),
            "drafts_static": runs["always"].stats.vllm["drafts"], "drafts_tail": runs["tail"].stats.vllm["drafts"],
            "drafts_plain": runs["plain"].stats.vllm["drafts"],
            "accept_len_vllm_always": round(runs["always"].stats.accept_len or 1.0, 3)}


def syncs(vllm, model, drafter) -> dict:
    """Cost of a policy sync (an MLP weight and the embedding changed) and of a drafter reload."""
    with torch.no_grad():  # written as an update and a refresh write them; a bump is what the engines sync by
        model.model.layers[0].mlp.down_proj.weight.mul_(1.001)
        model.get_input_embeddings().weight.mul_(1.001)
        drafter.fc.weight.mul_(1.001)
    bump(model)
    policy = vllm.sync()
    bump(drafter)
    reload = vllm.sync()
    return {"sync_s": round(policy["rollout/vllm_sync_s"], 3), "sync_reload_s": round(policy["rollout/vllm_reload_s"], 3),
            "drafter_reload_s": round(reload["rollout/vllm_sync_s"], 3),
            "drafter_reload_worker_s": round(reload["rollout/vllm_reload_s"], 4),
            "tied_embeddings": bool(model.config.tie_word_embeddings)}


def arms(vllm, torch_plain, torch_tail, torch_static, kw: dict, strategy, static: tuple) -> dict:
    """name -> callable of every timed arm (harness.best_of); vLLM's static arm: `static` = (its table, the
    threshold of SD at every batch), swapped in for its call only."""
    batch = len(kw["prompts"]) * kw["group_size"]

    def always(engine):
        with engine.fixed_strategy(strategy, batch_size=batch):
            return engine.generate(**kw)

    def vllm_static():
        with baselines.static_schedule(vllm, *static):
            return vllm.generate(**kw)

    return {"vllm_plain": lambda: vllm.generate(**kw, spec=False), "vllm_tail": lambda: vllm.generate(**kw),
            "vllm_always": lambda: always(vllm), "vllm_static": vllm_static,
            "torch_plain": lambda: torch_plain.generate(**kw, spec=False), "torch_tail": lambda: torch_tail.generate(**kw),
            "torch_always": lambda: always(torch_tail), "torch_static": lambda: torch_static.generate(**kw)}


def k0_tax(vllm, model, tok, cfg, eos, kw: dict, reps: int) -> dict:
    """The SD-built engine at K = 0 everywhere vs a second engine built without SD, interleaved."""
    plain_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"spec": False})})
    plain = VllmRolloutEngine.for_run(model, tok, plain_cfg, eos, None, Path("runs") / "bench-vllm-plain")
    try:
        best = harness.best_of({"k0": lambda: vllm.generate(**kw, spec=False),
                                "plain_engine": lambda: plain.generate(**kw, spec=False)}, reps)
    finally:
        plain.close()
    k0, eng = best["k0"][0], best["plain_engine"][0]
    return {"rollout_s_vllm_k0": round(k0, 3), "rollout_s_vllm_plain_engine": round(eng, 3), "k0_tax": k0 / eng}


def main(argv: list[str] | None = None) -> dict:
    args = harness.parse(harness.parser(__doc__, ("--reps", 2, "best of N"), ("--fit-epochs", 0, "drafter fit epochs"),
                                        ("--fit-prompts", 64, "training prompts the drafter is fit to"),
                                        ("--no-k0-tax", False, "skip the plain-built engine (the K = 0 tax)")), argv)
    cfg = harness.config(args, "model.dtype=float32", "rollout.drafter=eagle", "rollout.spec=true")
    r, n = cfg.rollout, cfg.rollout.prompts_per_step
    model, tok = load_target(cfg.model)
    eos = eos_token_ids(tok, model)
    prompts = encoder(tok, cfg)(load_dataset(cfg.data, tok).train["prompt"][: n + args.fit_prompts])
    drafter = fitted_drafter(model, cfg, RolloutEngine(model, r, eos, tok.pad_token_id), prompts[n:], args.fit_epochs)
    prompts = prompts[:n]
    vllm, start_s = harness.timed(lambda: VllmRolloutEngine.for_run(model, tok, cfg, eos, drafter,
                                                                    Path("runs") / "bench-vllm"))
    res = {"vllm_start_s": round(start_s, 2), "versions": vllm.versions, "vllm_threads": vllm.threads,
           "torch_threads": torch.get_num_threads(), "prompts": len(prompts), "group_size": r.group_size,
           "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "spec_threshold": vllm.threshold(),
           "depth": r.strategy.depth, "fit_epochs": args.fit_epochs, "vllm_sampled_sd": vllm.sampled_sd}
    torch_plain = RolloutEngine(model, r, eos, tok.pad_token_id, drafter=drafter)
    # the tail arm of both engines at vLLM's threshold (`auto`: priced from its cost curve at start-up)
    torch_tail = RolloutEngine(model, r.model_copy(update={"spec_threshold": vllm.threshold()}), eos, tok.pad_token_id, drafter=drafter,
                               tuner=StrategyTuner.from_config(r, seed=cfg.rl.seed) if r.tuner else None)
    kw = dict(prompts=prompts, group_size=r.group_size, temperature=r.temperature, seed=1)
    try:
        vllm.generate(prompts, temperature=0.0, spec_threshold=len(prompts))  # first calls warm vLLM's kernels up
        res.update(greedy_checks(vllm, torch_plain, prompts, vllm.threshold()))
        tables = {name: baselines.sweep(eng, prompts, r.tuner_buckets, r.strategy.depth, temperature=r.temperature)
                  for name, eng in (("vllm", vllm), ("torch", torch_plain))}
        torch_static = RolloutEngine(model, r.model_copy(update=baselines.config_update("static", cfg)), eos,
                                     tok.pad_token_id, drafter=drafter, tuner=baselines.static_tuner(tables["torch"]))
        static = (tables["vllm"], baselines.every_batch(cfg))
        best = harness.best_of(arms(vllm, torch_plain, torch_tail, torch_static, kw, r.strategy, static), args.reps)
        for name, (s, out) in best.items():
            res.update({f"rollout_s_{name}": round(s, 3), f"tokens_{name}": sum(map(len, out.response_ids)),
                        f"accept_len_{name}": round(out.stats.accept_len or 1.0, 3)})
        for eng, b in ((e, b) for e in ("vllm", "torch") for b in baselines.BASELINES):
            res[f"speedup_{eng}_vs_{b}"] = best[f"{eng}_{b}"][0] / best[f"{eng}_tail"][0]
        res.update({f"static_table_{e}": t for e, t in tables.items()})
        if not args.no_k0_tax:
            res.update(k0_tax(vllm, model, tok, cfg, eos, kw, args.reps))
        res.update(syncs(vllm, model, drafter), rebuilds=vllm.rebuilds)
    finally:
        vllm.close()
    return harness.write_result(res, "vllm_rollout", args, argv)


if __name__ == "__main__":
    main()
