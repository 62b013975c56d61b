"""fp32 vs bf16-mixed on one recipe, both arms in one run.

    python bench/precision.py conf/default.yaml --json out.json [--steps N] [--set k=v ...]

Two `Pipeline`s from the same seed and data: `fp32` (trainer.precision / drafter.precision fp32,
rollout.dtype float32) and `bf16` (bf16-mixed: fp32 master weights and optimizer state, bf16
autocast compute, the rollout decoding a bf16 copy; tlt.precision). Each arm builds its own
warm-start corpus (with its own rollout dtype) and trains its own drafter from a fresh cache, so
`warmstart_speedup` compares the same number of drafter steps (fp32 s / bf16 s, training only;
the corpus builds are reported apart). The RL steps are interleaved (the order alternates every
step) so the machine's noise hits both alike; seconds are means over steps 1..N-1 (step 0 pays
one-off costs). Rollout tokens/s, plain and SD, are measured on held-out prompts with each arm's
engine, interleaved, at the rollout temperature. `accept_len_*`: held-out greedy accept length
after the warm-start (tuner off, the fixed `drafter.eval_strategy`). Reward curves: the paired
permutation test of bench/rl_step.py. Accuracy: held-out greedy accuracy after the last step.
"""
from pathlib import Path

import harness
from harness import mean_excluding_first, parity

ARMS = {
    "fp32": ["trainer.precision=fp32", "drafter.precision=fp32", "rollout.dtype=float32"],
    "bf16": ["trainer.precision=bf16-mixed", "drafter.precision=bf16-mixed", "rollout.dtype=bfloat16"],
}


def arm_config(config: str, overrides: list[str], arm: str, steps: int, out_dir: Path):
    """RunConfig of one arm: its own cache (models linked in, corpora and drafters fresh) and run folder."""
    from tlt.config import load_config

    models = out_dir / f"cache-{arm}" / "models"
    if not models.exists():
        models.parent.mkdir(parents=True, exist_ok=True)
        cache = Path(load_config(config, overrides).model.cache_dir).resolve()
        cache.mkdir(parents=True, exist_ok=True)
        models.symlink_to(cache)
    extra = harness.run_overrides(out_dir / "runs", steps, f"bench-precision-{arm}") + [f"model.cache_dir={models}"]
    return load_config(config, list(overrides) + ARMS[arm] + extra)


def rollout_tok_s(pipes: dict, reps: int = 2) -> dict:
    """Tokens/s of each arm's engine on held-out prompts, SD off and on, interleaved over `reps`."""
    out: dict[str, list[float]] = {}
    for rep in range(reps):
        for arm in harness.rotated(list(pipes), rep):
            p = pipes[arm]
            r = p.cfg.rollout
            prompts = p.prompt_ids(p.dataset.heldout["prompt"][: r.prompts_per_step])
            for spec in (False, True):
                batch, dt = harness.timed(
                    lambda: p.engine.generate(prompts, group_size=r.group_size, spec=spec, seed=rep))
                out.setdefault(f"{arm}_{'sd' if spec else 'plain'}", []).append(sum(map(len, batch.response_ids)) / dt)
    return {k: sum(v) / len(v) for k, v in out.items()}


def run(config: str, overrides: list[str], steps: int, out_dir: Path) -> dict:
    cfgs = {a: arm_config(config, overrides, a, steps, out_dir) for a in ARMS}
    warm = {}
    with harness.pipelines(cfgs) as pipes:
        for arm, p in pipes.items():
            corpus = p.build_corpus()
            ws = p.warmstart(corpus)
            warm[arm] = {"corpus_s": corpus.build_s, "warmstart_s": ws.time_s, "train_steps": ws.train_steps,
                         "accept_len": ws.accept_len_after, "accept_len_sampled": ws.accept_len_sampled}
            print(f"{arm}: corpus {corpus.build_s:.1f} s, warm-start {ws.time_s:.1f} s ({ws.train_steps} steps), "
                  f"accept {ws.accept_len_after:.2f}", flush=True)
        tok_s = rollout_tok_s(pipes)
        records = harness.run_steps(pipes, steps)
        accuracy = {arm: p.evaluate(steps).accuracy for arm, p in pipes.items()}
    return {"warm": warm, "records": records, "tok_s": tok_s, "accuracy": accuracy}


def summarize(raw: dict, steps: int) -> dict:
    rec, warm, tok = raw["records"], raw["warm"], raw["tok_s"]
    mean = lambda arm, k: mean_excluding_first([s[k] for s in rec[arm]])  # noqa: E731
    step = {a: mean(a, "step_s") for a in ARMS}
    update = {a: mean(a, "update_policy_s") for a in ARMS}
    rollout = {a: mean(a, "rollout_s") for a in ARMS}
    return {
        "steps": steps, "excluded_from_means": "step 0" if steps > 1 else "nothing (one step)",
        "step_s_fp32": step["fp32"], "step_s_bf16": step["bf16"], "step_speedup": step["fp32"] / step["bf16"],
        "update_s_fp32": update["fp32"], "update_s_bf16": update["bf16"],
        "update_speedup": update["fp32"] / update["bf16"],
        "rollout_s_fp32": rollout["fp32"], "rollout_s_bf16": rollout["bf16"],
        "rollout_speedup_bf16": rollout["fp32"] / rollout["bf16"],
        "rollout_tok_s": tok, "rollout_tok_s_speedup_plain": tok["bf16_plain"] / tok["fp32_plain"],
        "rollout_tok_s_speedup_sd": tok["bf16_sd"] / tok["fp32_sd"],
        "warmstart_s_fp32": warm["fp32"]["warmstart_s"], "warmstart_s_bf16": warm["bf16"]["warmstart_s"],
        "warmstart_steps": warm["fp32"]["train_steps"],
        "warmstart_speedup": warm["fp32"]["warmstart_s"] / warm["bf16"]["warmstart_s"],
        "corpus_s_fp32": warm["fp32"]["corpus_s"], "corpus_s_bf16": warm["bf16"]["corpus_s"],
        "accept_len_fp32": warm["fp32"]["accept_len"], "accept_len_bf16": warm["bf16"]["accept_len"],
        "accept_len_sampled_fp32": warm["fp32"]["accept_len_sampled"],
        "accept_len_sampled_bf16": warm["bf16"]["accept_len_sampled"],
        "accuracy_fp32": raw["accuracy"]["fp32"], "accuracy_bf16": raw["accuracy"]["bf16"],
        **parity(rec["fp32"], rec["bf16"], ("fp32", "bf16")),
        "reward_curves": {a: [s["reward_mean"] for s in rec[a]] for a in ARMS},
        "step_s_curves": {a: [s["step_s"] for s in rec[a]] for a in ARMS},
    }


def main(argv: list[str] | None = None) -> dict:
    args = harness.parse(harness.parser(__doc__, steps=3), argv)
    with harness.workdir(None, "tlt-bench-precision-") as out_dir:
        res = summarize(run(args.config, args.overrides, args.steps, out_dir), args.steps)
    return harness.write_result(res, "precision", args, argv)


if __name__ == "__main__":
    main()
