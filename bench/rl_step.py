"""RL step benchmark: tlt's GRPO loop plain, with the adaptive drafter and with a frozen drafter, the
field's baselines (bench/baselines.py: SD always on, the best static draft length per tier), and TRL.

    python bench/rl_step.py conf/default.yaml --json out.json [--steps N] [--set k=v ...] [--no-trl] [--no-vllm]
                            [--baselines always,static | none] [--sweep-tokens 16]
    python bench/rl_step.py conf/longtail.yaml --paired --json out.json [--steps N] [--set rollout.backend=vllm]

--paired: the arms decode the same prompts on the same weights at every step (bench/paired.py).
"""
import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import harness
from harness import mean_excluding_first, parity
from tlt.prompts import render_prompt
from tlt.models import bundled_smollm2_dir, load_tokenizer
from tlt.rl.sampler import PromptSampler
from tlt.versions import write_weights

MODES = {"adaptive": ["rollout.spec=true", "drafter.where=spot"],  # the recipe's schedule, trained by the spot trainer
         "plain": ["rollout.spec=false", "drafter.schedule=frozen"],
         "frozen": ["rollout.spec=true", "drafter.schedule=frozen"]}
TRL_SPEC = ("torch==2.13.0", "trl==1.16.0")  # torch first: the local CPU wheel, never a CUDA build
CURVES = ("step_s", "rollout_s", "update_policy_s", "update_drafter_s", "reward_mean", "accept_len",
          "spec_enabled_share", "tail_share", "response_length_mean", "drafter_spot_steps",
          "tokens_per_target_forward", "ngram_share", "regret")
KEY = {"plain": "plain", "adaptive": "spec", "frozen": "frozen", "always": "always", "static": "static"}  # run ->
# suffix of its step_s_* / rollout_s_* keys
baselines = harness.load("baselines")


def mode_overrides(mode: str, base) -> list[str]:
    """Config overrides of one arm: MODES' three, or a baseline of bench/baselines.py (from the base config)."""
    return list(MODES[mode]) if mode in MODES else baselines.overrides(mode, base)


def calibrate_static(pipe, args) -> dict:
    """The static arm's table: bench/baselines.sweep on its engine (warm-start drafter, held-out prompts,
    the recipe's temperature), installed as its fixed schedule."""
    r = pipe.cfg.rollout
    prompts = pipe.prompt_ids(pipe.dataset.heldout["prompt"])
    table = baselines.sweep(pipe.engine, prompts, r.tuner_buckets, r.strategy.depth, args.sweep_tokens, r.temperature,
                            seed=pipe.cfg.rl.seed)
    baselines.install_static(pipe.engine, table)
    print(f"static schedule: depth per tier {dict(zip(table['buckets'], table['depths']))}", flush=True)
    return table


def run_modes(args, out_dir: Path, extra: tuple = (), names: dict | None = None) -> dict:
    """The three runs (arm names: `names` or the modes) from one warm-start drafter (the first arm builds
    the cache entry, the others hit it), interleaved: step records; held-out greedy evaluations with SD
    on at every decode step and off, on the same weights: token-identical (greedy SD is lossless)?"""
    modes = [*MODES, *arm_list(args)]
    names = names or {m: m for m in modes}
    base = harness.config(args, *extra)
    cfgs = {names[m]: harness.config(args, *extra, *mode_overrides(m, base),
                                     *harness.run_overrides(out_dir, args.steps, f"bench-{m}")) for m in modes}
    with harness.pipelines(cfgs) as pipes:
        for p in pipes.values():
            p.warmstart()
        ref = next(iter(pipes.values())).drafter.state_dict()
        same = all(sd.keys() == ref.keys() and all(sd[k].equal(ref[k]) for k in ref)
                   for sd in (p.drafter.state_dict() for p in pipes.values()))
        if not same:  # re-synced from the first arm's
            for p in pipes.values():
                write_weights(p.drafter, ref)  # bumped: the arm's engine decodes these weights
        table = calibrate_static(pipes[names["static"]], args) if "static" in names else None
        calibration = {arm: getattr(p.engine, "calibration", None) for arm, p in pipes.items()}
        runs = {arm: {"steps": steps} for arm, steps in harness.run_steps(pipes, args.steps).items()}
        for arm, p in pipes.items():
            if arm in (names.get(b) for b in baselines.BASELINES):
                continue  # timed in the steps only
            if p.cfg.rollout.spec:
                on, off = p.evaluate(args.steps, sd="always"), p.evaluate(args.steps, sd="off")
                texts = [[x["response"] for x in e.records] for e in (on, off)]
                runs[arm]["greedy_identical"] = texts[0] == texts[1]
                runs[arm]["eval"] = {"accuracy": on.accuracy, "accuracy_no_sd": off.accuracy,
                                     "accept_len": on.accept_len, "eval_s": on.time_s, "eval_s_no_sd": off.time_s}
            elif p.cfg.rollout.backend != "vllm":  # a vLLM engine built without SD cannot measure accept lengths
                ev = p.evaluate(args.steps)
                runs[arm]["eval"] = {"accuracy": ev.accuracy, "eval_s": ev.time_s}
        train_rows, cfg = pipes[names["plain"]].dataset.train, pipes[names["plain"]].cfg
    del pipes  # free the models before the next arms
    gc.collect()
    return {"runs": runs, "same_warmstart_drafter": same, "train_rows": train_rows, "cfg": cfg, "static_table": table,
            "calibration": calibration}


def arm_list(args) -> list[str]:
    """The baseline arms asked for (--baselines): a subset of bench/baselines.BASELINES."""
    asked = [] if args.baselines in ("", "none") else args.baselines.split(",")
    unknown = set(asked) - set(baselines.BASELINES)
    if unknown:
        raise SystemExit(f"--baselines: unknown arm(s) {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(baselines.BASELINES)} or none")
    return asked


# ---------------------------------------------------------------- TRL peer
def trl_batching(prompts_per_step: int, group_size: int, micro_batch: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps): one optimizer step consumes
    prompts x G completions, in micro-batches of at most `micro_batch`."""
    per_device = math.gcd(prompts_per_step * group_size, micro_batch)
    return per_device, prompts_per_step * group_size // per_device


def write_trl_prompts(train_rows, cfg, steps: int, path: Path) -> list[list[str]]:
    """The prompts tlt's sampler draws for steps 0..N-1, chat template applied as tlt does."""
    tok, d, sampler = load_tokenizer(cfg.model), cfg.data, PromptSampler(train_rows, seed=cfg.data.seed)
    batches = [sampler.next(cfg.rollout.prompts_per_step) for _ in range(steps)]
    lines = [json.dumps({"prompt": render_prompt(tok, p, d.instruction, d.system_prompt), "answer": str(a)})
             for rows in batches for p, a in zip(rows["prompt"], rows["answer"])]
    path.write_text("".join(line + "\n" for line in lines))
    return [list(rows["prompt"]) for rows in batches]


def run_trl(cfg, train_rows, steps: int, out_dir: Path) -> dict:
    """bench/trl_grpo.py in `.venv-trl` (created with TRL_SPEC once; a stamp makes reruns a no-op) on the
    same prompts, lengths and GRPO settings."""
    venv = harness.ROOT / ".venv-trl"
    stamp, py = venv / ".trl-installed", venv / "bin" / "python"
    if not (stamp.exists() and stamp.read_text().strip() == " ".join(TRL_SPEC)):
        print(f"bench: creating {venv} with {' '.join(TRL_SPEC)} (once, ~2 min)", flush=True)
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for spec in TRL_SPEC:  # torch alone first, so trl's dependency on torch is already met
            subprocess.run([str(py), "-m", "pip", "install", "-q", spec], check=True)
        stamp.write_text(" ".join(TRL_SPEC) + "\n")
    write_trl_prompts(train_rows, cfg, steps, out_dir / "trl_prompts.jsonl")
    r, rl = cfg.rollout, cfg.rl
    per_device, accum = trl_batching(r.prompts_per_step, r.group_size, cfg.trainer.micro_batch_size)
    grpo = {"output_dir": str(out_dir / "trl"), "max_steps": steps, "learning_rate": rl.lr,
            "weight_decay": rl.weight_decay, "max_grad_norm": cfg.trainer.grad_clip, "num_generations": r.group_size,
            "max_completion_length": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "epsilon": rl.clip_low, "epsilon_high": rl.clip_high, "beta": rl.kl_coef, "seed": rl.seed,
            "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accum,
            "bf16": cfg.trainer.precision == "bf16-mixed"}  # TRL at tlt's precision: fp32 weights, bf16 autocast
    args = {"model_dir": str(bundled_smollm2_dir(cfg.model.cache_dir)), "prompts": str(out_dir / "trl_prompts.jsonl"),
            "out_json": str(out_dir / "trl.json"), "grpo": grpo}
    (out_dir / "trl_args.json").write_text(json.dumps(args, indent=2))
    subprocess.run([str(py), str(harness.ROOT / "bench" / "trl_grpo.py"), str(out_dir / "trl_args.json")], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return {**json.loads((out_dir / "trl.json").read_text()),
            "batching": {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accum}}


# ---------------------------------------------------------------- result
def summarize(tlt: dict, trl: dict | None, steps: int) -> dict:
    runs = tlt["runs"]
    curves = {m: {k: [s[k] for s in runs[m]["steps"]] for k in CURVES} for m in runs}
    mean = {k: {m: mean_excluding_first([v or 0.0 for v in curves[m][k]]) for m in runs}
            for k in ("step_s", "rollout_s", "tokens_per_target_forward", "ngram_share")}
    step, roll, tpf = mean["step_s"], mean["rollout_s"], mean["tokens_per_target_forward"]
    a = runs["adaptive"]["steps"]
    share, speedup = roll["plain"] / step["plain"], roll["plain"] / roll["adaptive"]
    return {"steps": steps, "excluded_from_means": "step 0" if steps > 1 else "nothing (one step)",
            **{f"{k}_{KEY[m]}": mean[k][m] for k in ("step_s", "rollout_s") for m in KEY if m in runs},
            **baseline_keys(step, roll), "static_table": tlt.get("static_table"),
            # the bandit's summed regret after the last step (s), and the engines' start-up calibration
            "regret": {m: runs[m]["steps"][-1]["regret"] for m in runs}, "calibration": tlt.get("calibration"),
            "step_s_trl": trl["step_s"] if trl else None, "speedup_vs_plain": step["plain"] / step["adaptive"],
            "speedup_frozen_vs_plain": step["plain"] / step["frozen"],
            "speedup_vs_trl": trl["step_s"] / step["adaptive"] if trl else None,
            "rollout_speedup": speedup, "rollout_speedup_frozen": roll["plain"] / roll["frozen"],
            "rollout_share_plain": share, "amdahl_bound": 1.0 / (1.0 - share + share / speedup),
            "tokens_per_target_forward": tpf["adaptive"], "tokens_per_target_forward_plain": tpf["plain"],
            "tokens_per_target_forward_frozen": tpf["frozen"], "ngram_share": mean["ngram_share"]["adaptive"],
            **{f"accept_len_{m}": runs[m]["eval"]["accept_len"] for m in ("adaptive", "frozen")},
            "accept_len_what": "held-out greedy accept length at batch 1 after the last step (Pipeline.evaluate)",
            **{f"rollout_accept_len_last_{m}": runs[m]["steps"][-1]["accept_len"] for m in ("adaptive", "frozen")},
            "drafter_overhead_share": sum(s["update_drafter_s"] for s in a) / sum(s["step_s"] for s in a),
            "drafter_sync_share": sum(s["sync_s"] for s in a) / sum(s["step_s"] for s in a),
            "same_warmstart_drafter": tlt["same_warmstart_drafter"],
            "same_prompts": all([s["prompts"] for s in r["steps"]] == [s["prompts"] for s in a] for r in runs.values()),
            "greedy_eval_identical": bool(runs["adaptive"]["greedy_identical"] and runs["frozen"]["greedy_identical"]),
            **parity(runs["plain"]["steps"], a), "curves": curves,
            "eval": {m: runs[m]["eval"] for m in runs if "eval" in runs[m]},
            "trl": trl}


def baseline_keys(step: dict, roll: dict, adaptive: str = "adaptive", prefix: str = "") -> dict:
    """speedup_vs_{always,static}: a baseline's mean step over tlt's (`adaptive`); rollout_speedup_vs_*
    the same for the rollout; only for the baselines that ran."""
    out = {}
    for b in baselines.BASELINES:
        if f"{prefix}{b}" in step:
            out[f"speedup_{prefix}vs_{b}"] = step[f"{prefix}{b}"] / step[adaptive]
            out[f"rollout_speedup_{prefix}vs_{b}"] = roll[f"{prefix}{b}"] / roll[adaptive]
    return out


def main(argv: list[str] | None = None) -> dict:
    args = harness.parse(harness.parser(__doc__, ("--no-trl", False, "skip the TRL peer run"),
                                        ("--baselines", "always,static", "baseline arms (bench/baselines.py), or none"),
                                        ("--sweep-tokens", 16, "tokens per call of the static arm's calibration sweep"),
                                        ("--paired", False, "paired mode: every arm on the same prompts and weights"),
                                        ("--no-vllm", False, "skip the vLLM arms (bench/rl_step_vllm.py)"),
                                        steps=3, out_dir=True), argv)
    vllm_arms = harness.load("rl_step_vllm")
    if args.paired:
        with harness.workdir(args.out_dir, "tlt-bench-rl-") as out_dir:
            res = harness.load("paired").run_paired(args, out_dir)
            return harness.write_result({"mode": "paired", "steps": args.steps, **res}, "rl_step", args, argv)
    with harness.workdir(args.out_dir, "tlt-bench-rl-") as out_dir:
        tlt = run_modes(args, out_dir)
        vllm = None if args.no_vllm or not vllm_arms.available() else vllm_arms.run_vllm(args, out_dir / "vllm")
        trl = None if args.no_trl else run_trl(tlt["cfg"], tlt["train_rows"], args.steps, out_dir)
        return harness.write_result(vllm_arms.merge(summarize(tlt, trl, args.steps), vllm), "rl_step", args, argv)


if __name__ == "__main__":
    main()
