"""RL step benchmark: tlt's GRPO loop plain, with the adaptive drafter and with a frozen drafter, and TRL.

The three tlt runs and TRL's GRPOTrainer as the peer use the same model, prompts, group size and lengths.

    python bench/rl_step.py conf/default.yaml --json out.json [--steps N] [--set k=v ...] [--no-trl] [--no-vllm]

The three tlt runs live in this process, built with `Pipeline(cfg)` from the same seed and data,
and are interleaved step by step (the order rotates every step) so the shared machine's noise
hits them alike: plain (`rollout.spec=false`, no drafter training), adaptive (SD + spot trainer
in the rollout tail) and frozen (SD, warm-start drafter only). Adaptive and frozen start from the
same warm-start drafter (one cache entry, checked tensor by tensor). Step seconds are
`timing_s/step` means over steps 1..N-1: step 0 pays one-off costs (AdamW state allocation,
first-touch of the KV cache, the spot worker's first batches).

Accuracy parity: SD is lossless in distribution, not sample for sample, so the plain and adaptive
`reward/mean` curves are compared with a paired sign-flip permutation test (see `parity`), and
greedy evaluation is checked token-identical with SD forced on vs off on the same weights.
The vLLM arms (bench/rl_step_vllm.py: the same three loops on `rollout.backend=vllm`) run next
whenever the vLLM venv exists. TRL runs afterwards in its own venv (`.venv-trl`, created once)
through bench/trl_grpo.py.
"""
from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from harness import mean_excluding_first  # noqa: E402

ROOT = harness.ROOT
MODES = {  # overrides per run; "adaptive" keeps the recipe's schedule, trained by the spot trainer
    "plain": ["rollout.spec=false", "drafter.schedule=frozen"],
    "adaptive": ["rollout.spec=true", "drafter.where=spot"],
    "frozen": ["rollout.spec=true", "drafter.schedule=frozen"],
}
ALPHA = 0.01
N_PERM = 20_000
TRL_SPEC = ("torch==2.13.0", "trl==1.16.0")  # torch first: the local CPU wheel, never a CUDA build
PARITY_TEST = ("paired sign-flip permutation test (two-sided, 20000 draws, seed 0) on the mean over "
               "(step, prompt) pairs of the difference of group-mean rewards, adaptive - plain "
               "(same prompts per step in both runs), alpha 0.01; per-step Welch t-tests on the "
               "per-sample rewards are reported for information (Bonferroni alpha 0.01/N)")


# ---------------------------------------------------------------- configs and the tlt runs
def mode_config(config: str | None, overrides: list[str], mode: str, steps: int, out_dir: Path):
    """RunConfig of one run (harness.run_overrides: no checkpoint inside or after the timed steps)."""
    from tlt.config import load_config

    return load_config(config, list(overrides) + MODES[mode] + harness.run_overrides(out_dir, steps, f"bench-{mode}"))


def shared_warmstart(pipes: dict) -> bool:
    """Warm-start adaptive, then the others (a cache hit: the key hashes only warm-start inputs);
    True if all drafters are equal (they are re-synced from adaptive's on a mismatch)."""
    src = pipes["adaptive"]
    src.warmstart()
    for name, p in pipes.items():
        if name != "adaptive":
            p.warmstart()
    ref = src.drafter.state_dict()
    same = True
    for name, p in pipes.items():
        sd = p.drafter.state_dict()
        if sd.keys() != ref.keys() or any(not sd[k].equal(ref[k]) for k in ref):
            same = False
            p.drafter.load_state_dict(ref, strict=True)
    return same


def step_record(summary) -> dict:
    """What the benchmark keeps of one step: its metrics and the per-sample rewards by group."""
    m, samples = summary.metrics, summary.samples
    ids = list(dict.fromkeys(s["prompt_id"] for s in samples))
    prompts = list(dict.fromkeys(s["prompt"] for s in samples))
    return {"step_s": m["timing_s/step"], "rollout_s": m.get("timing_s/rollout", 0.0),
            "update_policy_s": m.get("timing_s/update_policy", 0.0),
            "update_drafter_s": m.get("timing_s/update_drafter", 0.0), "sync_s": m.get("timing_s/sync", 0.0),
            "reward_mean": m["reward/mean"], "accept_len": m.get("spec/accept_len/mean"),
            "spec_enabled_share": m.get("spec/enabled_share", 0.0), "tail_share": m.get("rollout/tail_share"),
            "response_length_mean": m.get("rollout/response_length/mean"),
            "drafter_spot_steps": m.get("drafter/spot_steps"), "drafter_loss": m.get("drafter/loss"),
            "tokens_per_target_forward": m.get("rollout/tokens_per_target_forward"),
            "ngram_share": m.get("spec/ngram_share", 0.0),
            "rewards": [float(s["reward"]) for s in samples],
            "group_index": [ids.index(s["prompt_id"]) for s in samples], "prompts": prompts}


def greedy_identical(pipe, step: int) -> tuple[bool, dict]:
    """Evaluate with SD on at every decode step (`sd="always"`), then with SD off, on the same
    weights; greedy SD must give token-identical responses."""
    on = pipe.evaluate(step, sd="always")
    records_on = pipe.last_eval_records
    off = pipe.evaluate(step, sd="off")
    same = [a["response"] for a in records_on] == [b["response"] for b in pipe.last_eval_records]
    return same, {"accuracy": on.accuracy, "accuracy_no_sd": off.accuracy, "accept_len": on.accept_len,
                  "eval_s": on.time_s, "eval_s_no_sd": off.time_s}


def run_tlt(config: str | None, overrides: list[str], steps: int, out_dir: Path) -> dict:
    """The three runs, interleaved step by step; returns per-mode step records and end results."""
    runs: dict[str, dict] = {m: {"steps": []} for m in MODES}

    def on_step(m, step, summary):
        runs[m]["steps"].append(step_record(summary))
        print(f"step {step} {m:>8}: {summary.step_s:7.1f} s, reward {summary.reward_mean:.3f}, "
              f"accept {summary.accept_len or 0:.2f}", flush=True)

    with harness.pipelines({m: mode_config(config, overrides, m, steps, out_dir) for m in MODES}) as pipes:
        same_drafter = shared_warmstart(pipes)
        harness.interleave(pipes, steps, on_step)
        for m, p in pipes.items():
            if p.cfg.rollout.spec:
                same, ev = greedy_identical(p, steps)
                runs[m].update(eval=ev, greedy_identical=same)
            else:
                ev = p.evaluate(steps)
                runs[m]["eval"] = {"accuracy": ev.accuracy, "eval_s": ev.time_s}
        train_rows, cfg = pipes["plain"].dataset.train, pipes["plain"].cfg
    del pipes  # free the three models before TRL runs
    gc.collect()
    return {"runs": runs, "same_warmstart_drafter": same_drafter, "train_rows": train_rows, "cfg": cfg}


# ---------------------------------------------------------------- statistics
def group_means(rewards: list[float], group_index: list[int]) -> np.ndarray:
    r, g = np.asarray(rewards, float), np.asarray(group_index)
    return np.array([r[g == k].mean() for k in sorted(set(group_index))])


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided Welch t-test p-value; 1.0 when both samples are constant and equal."""
    from scipy import stats

    if np.std(a) == 0 and np.std(b) == 0:
        return 1.0 if np.mean(a) == np.mean(b) else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def parity(plain: list[dict], spec: list[dict], alpha: float = ALPHA, n_perm: int = N_PERM) -> dict:
    """`PARITY_TEST` on two runs' step records (same prompts per step); match = p >= alpha."""
    diffs = np.concatenate([group_means(s["rewards"], s["group_index"]) - group_means(p["rewards"], p["group_index"])
                            for p, s in zip(plain, spec)])
    p_value = harness.sign_flip_p(diffs, n_perm)
    welch = [welch_p(p["rewards"], s["rewards"]) for p, s in zip(plain, spec)]
    return {"parity_test": PARITY_TEST, "parity_p_value": p_value, "parity_n_pairs": int(len(diffs)),
            "parity_mean_diff": float(diffs.mean()), "reward_curves_match": bool(p_value >= alpha),
            "welch_p_per_step": welch, "welch_all_steps_match": bool(all(w >= alpha / len(welch) for w in welch))}


# ---------------------------------------------------------------- TRL peer
def trl_batching(prompts_per_step: int, group_size: int, micro_batch: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) so that one optimizer step
    consumes prompts x G completions, in micro-batches of at most `micro_batch`."""
    total = prompts_per_step * group_size
    per_device = math.gcd(total, micro_batch)
    return per_device, total // per_device


def ensure_trl_venv(venv: Path = ROOT / ".venv-trl") -> Path:
    """Create `venv` with TRL once (a stamp makes reruns a no-op); returns its python."""
    stamp, py = venv / ".trl-installed", venv / "bin" / "python"
    if stamp.exists() and stamp.read_text().strip() == " ".join(TRL_SPEC):
        return py
    print(f"bench: creating {venv} with {' '.join(TRL_SPEC)} (once, ~2 min)", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for spec in TRL_SPEC:  # torch alone first, so trl's dependency on torch is already met
        subprocess.run([str(py), "-m", "pip", "install", "-q", spec], check=True)
    stamp.write_text(" ".join(TRL_SPEC) + "\n")
    return py


def write_trl_prompts(train_rows, cfg, steps: int, path: Path) -> list[list[str]]:
    """The prompts tlt's sampler draws for steps 0..N-1, chat template applied as tlt does."""
    from tlt.data import render_prompt
    from tlt.models import load_tokenizer
    from tlt.rl.sampler import PromptSampler

    tok, d = load_tokenizer(cfg.model), cfg.data
    sampler, per_step = PromptSampler(train_rows, seed=d.seed), []
    with path.open("w") as f:
        for _ in range(steps):
            rows = sampler.next(cfg.rollout.prompts_per_step)
            per_step.append(list(rows["prompt"]))
            for prompt, answer in zip(rows["prompt"], rows["answer"]):
                text = render_prompt(tok, prompt, d.instruction, d.system_prompt)
                f.write(json.dumps({"prompt": text, "answer": str(answer)}) + "\n")
    return per_step


def run_trl(cfg, train_rows, steps: int, out_dir: Path) -> dict:
    from tlt.models import bundled_smollm2_dir

    py = ensure_trl_venv()
    prompts = out_dir / "trl_prompts.jsonl"
    write_trl_prompts(train_rows, cfg, steps, prompts)
    per_device, accum = trl_batching(cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.trainer.micro_batch_size)
    r, rl = cfg.rollout, cfg.rl
    args = {"model_dir": str(bundled_smollm2_dir(cfg.model.cache_dir)), "prompts": str(prompts),
            "out_json": str(out_dir / "trl.json"), "output_dir": str(out_dir / "trl"), "steps": steps,
            "num_generations": r.group_size, "max_completion_length": r.max_new_tokens, "temperature": r.temperature,
            "top_p": r.top_p, "lr": rl.lr, "weight_decay": rl.weight_decay, "max_grad_norm": cfg.trainer.grad_clip,
            "epsilon": rl.clip_low, "epsilon_high": rl.clip_high, "beta": rl.kl_coef, "seed": rl.seed,
            "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accum,
            "bf16": cfg.trainer.precision == "bf16-mixed"}  # TRL at tlt's precision: fp32 weights, bf16 autocast
    (out_dir / "trl_args.json").write_text(json.dumps(args, indent=2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(py), str(ROOT / "bench" / "trl_grpo.py"), str(out_dir / "trl_args.json")], check=True, env=env)
    out = json.loads((out_dir / "trl.json").read_text())
    out["batching"] = {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accum}
    return out


# ---------------------------------------------------------------- result and table
def summarize(tlt: dict, trl: dict | None, steps: int) -> dict:
    runs = tlt["runs"]
    curve = lambda m, k: [s[k] for s in runs[m]["steps"]]  # noqa: E731 - per-step series of one run
    step_s = {m: mean_excluding_first(curve(m, "step_s")) for m in runs}
    a = runs["adaptive"]["steps"]
    rollout_s = {m: mean_excluding_first(curve(m, "rollout_s")) for m in runs}
    rollout_speedup = rollout_s["plain"] / rollout_s["adaptive"]
    share = rollout_s["plain"] / step_s["plain"]
    tpf = {m: mean_excluding_first([x or 0.0 for x in curve(m, "tokens_per_target_forward")]) for m in runs}
    res = {"steps": steps, "excluded_from_means": "step 0" if steps > 1 else "nothing (one step)",
           "step_s_plain": step_s["plain"], "step_s_spec": step_s["adaptive"], "step_s_frozen": step_s["frozen"],
           "step_s_trl": trl["step_s"] if trl else None,
           "speedup_vs_plain": step_s["plain"] / step_s["adaptive"],
           "speedup_frozen_vs_plain": step_s["plain"] / step_s["frozen"],
           "speedup_vs_trl": trl["step_s"] / step_s["adaptive"] if trl else None,
           "rollout_s_plain": rollout_s["plain"], "rollout_s_spec": rollout_s["adaptive"],
           "rollout_s_frozen": rollout_s["frozen"], "rollout_speedup": rollout_speedup,
           "rollout_speedup_frozen": rollout_s["plain"] / rollout_s["frozen"],
           "rollout_share_plain": share, "amdahl_bound": 1.0 / (1.0 - share + share / rollout_speedup),
           "tokens_per_target_forward": tpf["adaptive"], "tokens_per_target_forward_plain": tpf["plain"],
           "tokens_per_target_forward_frozen": tpf["frozen"],
           "ngram_share": mean_excluding_first(curve("adaptive", "ngram_share")),
           "accept_len_adaptive": runs["adaptive"]["eval"]["accept_len"],
           "accept_len_frozen": runs["frozen"]["eval"]["accept_len"],
           "accept_len_what": "held-out greedy accept length at batch 1 after the last step (Pipeline.evaluate)",
           "rollout_accept_len_last_adaptive": a[-1]["accept_len"],
           "rollout_accept_len_last_frozen": runs["frozen"]["steps"][-1]["accept_len"],
           "drafter_overhead_share": sum(s["update_drafter_s"] for s in a) / sum(s["step_s"] for s in a),
           "drafter_sync_share": sum(s["sync_s"] for s in a) / sum(s["step_s"] for s in a),
           "same_warmstart_drafter": tlt["same_warmstart_drafter"],
           "same_prompts": all(runs[m]["steps"][i]["prompts"] == a[i]["prompts"] for m in runs for i in range(steps)),
           "greedy_eval_identical": bool(runs["adaptive"]["greedy_identical"] and runs["frozen"]["greedy_identical"]),
           **parity(runs["plain"]["steps"], a),
           "curves": {m: {k: curve(m, k) for k in ("step_s", "rollout_s", "update_policy_s", "update_drafter_s",
                                                    "reward_mean", "accept_len", "spec_enabled_share", "tail_share",
                                                    "response_length_mean", "drafter_spot_steps",
                                                    "tokens_per_target_forward", "ngram_share")} for m in runs},
           "eval": {m: runs[m]["eval"] for m in runs}, "trl": trl}
    return res


def print_table(res: dict) -> None:
    c = res["curves"]
    rows = [{"run": m, **{k: mean_excluding_first(c[m][k]) for k in ("step_s", "rollout_s", "update_policy_s",
                                                                       "update_drafter_s")},
             "accept": res["eval"][m].get("accept_len"), "acc": res["eval"][m]["accuracy"],
             "rewards": " ".join(f"{r:.3f}" for r in c[m]["reward_mean"])} for m in ("plain", "adaptive", "frozen")]
    if res["trl"]:
        rows.append({"run": "trl", "step_s": res["trl"]["step_s"],
                     "rewards": " ".join(f"{r:.3f}" for r in res["trl"]["reward_mean"])})
    harness.print_table(rows, {"run": ("run", "s"), "step_s": ("step s", ".1f"), "rollout_s": ("rollout s", ".1f"),
                               "update_policy_s": ("policy s", ".1f"), "update_drafter_s": ("drafter s", ".2f"),
                               "accept": ("accept", ".2f"), "acc": ("eval acc", ".3f"),
                               "rewards": ("reward/mean per step", "s")})
    trl = f", vs TRL x{res['speedup_vs_trl']:.2f}" if res["trl"] else ""
    print(f"\nmeans over steps 1..N-1 ({res['excluded_from_means']} excluded); speedup adaptive vs plain "
          f"x{res['speedup_vs_plain']:.2f}, frozen vs plain x{res['speedup_frozen_vs_plain']:.2f}{trl}")
    print(f"rollout x{res['rollout_speedup']:.2f} (frozen x{res['rollout_speedup_frozen']:.2f}), rollout share "
          f"{res['rollout_share_plain']:.2f} of the plain step -> Amdahl bound x{res['amdahl_bound']:.2f}; tokens per "
          f"target forward {res['tokens_per_target_forward']:.2f} (plain {res['tokens_per_target_forward_plain']:.2f}); "
          f"n-gram share of SD tokens {res['ngram_share']:.2f}")
    print(f"drafter overhead share {res['drafter_overhead_share']:.3f} (sync {res['drafter_sync_share']:.3f}); "
          f"same warm-start drafter {res['same_warmstart_drafter']}; greedy eval identical {res['greedy_eval_identical']}")
    print(f"reward curves match: {res['reward_curves_match']} (p = {res['parity_p_value']:.3f}, "
          f"{res['parity_n_pairs']} pairs, mean diff {res['parity_mean_diff']:+.3f}); {res['parity_test']}")


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, steps=3, out_dir=True)
    ap.add_argument("--no-trl", action="store_true", help="skip the TRL peer run")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM arms (bench/rl_step_vllm.py)")
    args = ap.parse_args(argv)
    vllm_arms = harness.load("rl_step_vllm")  # vLLM plain / tail SD / frozen, whenever vLLM's venv exists
    with harness.workdir(args.out_dir, "tlt-bench-rl-") as out_dir:
        tlt = run_tlt(args.config, args.overrides, args.steps, out_dir)
        vllm = None if args.no_vllm or not vllm_arms.available() else vllm_arms.run_vllm(
            args.config, args.overrides, args.steps, out_dir)
        trl = None if args.no_trl else run_trl(tlt["cfg"], tlt["train_rows"], args.steps, out_dir)
        res = vllm_arms.merge(summarize(tlt, trl, args.steps), vllm)
    print_table(res)
    vllm_arms.print_lines(res)
    return harness.write_result(res, "rl_step", args, argv)


if __name__ == "__main__":
    main()
