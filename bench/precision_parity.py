"""Does bf16-mixed training learn as fp32 does? Both arms over several seeds, in one run.

    python bench/precision_parity.py conf/default.yaml --seeds 3 --steps 8 --json out.json [--set k=v ...]

For each seed, two `Pipeline`s (the arms of bench/precision.py: `fp32`, and `bf16` = fp32 master
weights, bf16 autocast, bf16 rollout copy) start from the same weights, data and seed and take
their RL steps interleaved. The drafter is the model-free n-gram one (no warm-start: this measures
training, not drafting; SD is lossless either way). Held-out greedy accuracy before the first step
and after the last, on a larger held-out split than the recipe's (`--heldout`).

Reported: per seed and arm the reward curve and both accuracies; pooled over seeds, the paired
sign-flip test of bench/rl_step.py on the group-mean rewards (same prompts per step), and the
accuracy gain (after - before) of each arm with the paired test on the per-prompt correctness
differences of the two arms after the last step.
"""
from pathlib import Path

import numpy as np

import harness
from harness import parity, sign_flip_p
from precision import ARMS, arm_config


def one_seed(config: str, overrides: list[str], seed: int, steps: int, out_dir: Path) -> dict:
    extra = [*overrides, f"rl.seed={seed}", "rollout.drafter=ngram"]
    out = {a: {} for a in ARMS}
    with harness.pipelines({a: arm_config(config, extra, a, steps, out_dir / f"seed{seed}") for a in ARMS}) as pipes:
        for arm, p in pipes.items():
            out[arm]["accuracy_before"] = p.evaluate(0).accuracy
        for arm, records in harness.run_steps(pipes, steps).items():
            out[arm]["records"] = records
        for arm, p in pipes.items():
            ev = p.evaluate(steps)
            out[arm].update(accuracy_after=ev.accuracy, correct_after=[float(r["reward"] >= 1.0) for r in ev.records])
    return out


def summarize(runs: dict[int, dict]) -> dict:
    rec = {a: [r for s in runs.values() for r in s[a]["records"]] for a in ARMS}
    acc_diff = np.concatenate([np.array(s["bf16"]["correct_after"]) - np.array(s["fp32"]["correct_after"])
                               for s in runs.values()])
    mean = lambda a, k: float(np.mean([s[a][k] for s in runs.values()]))  # noqa: E731
    return {
        "seeds": sorted(runs), **parity(rec["fp32"], rec["bf16"], ("fp32", "bf16")),
        "reward_mean_fp32": float(np.mean([r["reward_mean"] for r in rec["fp32"]])),
        "reward_mean_bf16": float(np.mean([r["reward_mean"] for r in rec["bf16"]])),
        "accuracy_before_fp32": mean("fp32", "accuracy_before"), "accuracy_before_bf16": mean("bf16", "accuracy_before"),
        "accuracy_after_fp32": mean("fp32", "accuracy_after"), "accuracy_after_bf16": mean("bf16", "accuracy_after"),
        "accuracy_after_diff": float(acc_diff.mean()), "accuracy_after_p_value": sign_flip_p(acc_diff),
        "accuracy_test": "paired sign-flip permutation test on per-prompt correctness after the last step, bf16 - "
                         "fp32, pooled over seeds (same held-out prompts)",
        "per_seed": {str(k): {a: {"reward_curve": [r["reward_mean"] for r in v[a]["records"]],
                                  "accuracy_before": v[a]["accuracy_before"], "accuracy_after": v[a]["accuracy_after"]}
                              for a in ARMS} for k, v in runs.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, steps=8)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--heldout", type=int, default=96, help="held-out prompts (data.heldout_size)")
    args = harness.parse(ap, argv)
    overrides = [*args.overrides, f"data.heldout_size={args.heldout}"]
    with harness.workdir(None, "tlt-bench-parity-") as out_dir:
        runs = {s: one_seed(args.config, overrides, s, args.steps, out_dir) for s in range(args.seeds)}
    res = {"steps": args.steps, **summarize(runs)}
    return harness.write_result(res, "precision_parity", args, argv)


if __name__ == "__main__":
    main()
