"""When to train the drafter on a CPU box: what each refresh schedule delivers per RL step.

    python bench/schedules.py conf/default.yaml --steps 3 --json out.json [--drafter-steps 4] [--set k=v ...]

Arms, one Pipeline each, interleaved step by step (rotating who goes first), same seed, prompts
and warm-started drafter (a cache hit after the first), SD on in the rollout tail as configured:
  none        no drafter training (`drafter.schedule: frozen`): the rollout and step without it
  spot        the spot trainer process trains during the rollout's tail (`drafter.where: spot`)
  sequential  a fixed budget of `--drafter-steps` drafter steps after the policy update
              (`drafter.where: sequential`, `drafter.refresh_steps`)
Per arm (means over steps 1..N-1, step 0 excluded: the buffer is empty there): drafter steps per
RL step, drafter seconds inside the step, rollout and step seconds, and the rollout's slowdown
against `none` (the spot trainer competes with decoding for the same 2 cores).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

ARMS = {"none": ["drafter.schedule=frozen"],
        "spot": ["drafter.where=spot"],
        "sequential": ["drafter.where=sequential"]}


def arm_config(config, overrides, arm: str, steps: int, drafter_steps: int, out_dir: Path):
    from tlt.config import load_config

    base = harness.run_overrides(out_dir / arm, steps) + [f"drafter.refresh_steps={drafter_steps}"]
    return load_config(config, base + list(overrides) + ARMS[arm])


def record(m: dict, prev_steps: float) -> dict:
    return {"step_s": m["timing_s/step"], "rollout_s": m.get("timing_s/rollout", 0.0),
            "update_policy_s": m.get("timing_s/update_policy", 0.0),
            "drafter_s": m.get("timing_s/update_drafter", 0.0),
            "drafter_steps": m.get("drafter/steps", prev_steps) - prev_steps,
            "spec_enabled_share": m.get("spec/enabled_share", 0.0), "tail_share": m.get("rollout/tail_share", 0.0),
            "accept_len": m.get("spec/accept_len/mean")}


def run(config, overrides, steps: int, drafter_steps: int, out_dir: Path) -> dict:
    recs: dict[str, list[dict]] = {a: [] for a in ARMS}
    totals = {a: 0.0 for a in ARMS}

    def on_step(a, step, s):
        recs[a].append(record(s.metrics, totals[a]))
        totals[a] = s.metrics.get("drafter/steps", totals[a])
        r = recs[a][-1]
        print(f"step {step} {a:>10}: {r['step_s']:6.1f} s, rollout {r['rollout_s']:5.1f} s, drafter "
              f"{r['drafter_steps']:.0f} steps / {r['drafter_s']:.2f} s", flush=True)

    with harness.pipelines({a: arm_config(config, overrides, a, steps, drafter_steps, out_dir) for a in ARMS}) as pipes:
        for p in pipes.values():
            p.warmstart()
        harness.interleave(pipes, steps, on_step)
    return recs


def summarize(recs: dict, steps: int, drafter_steps: int) -> dict:
    def mean(a, k):
        vals = [r[k] for r in recs[a][1:]] or [r[k] for r in recs[a]]
        return float(np.mean(vals))

    res = {"steps": steps, "excluded_from_means": "step 0 (empty buffer)", "drafter_steps_budget": drafter_steps,
           "arms": {}}
    for a in ARMS:
        res["arms"][a] = {k: mean(a, k) for k in ("step_s", "rollout_s", "update_policy_s", "drafter_s",
                                                   "drafter_steps", "spec_enabled_share", "tail_share")}
        res["arms"][a]["drafter_share_of_step"] = res["arms"][a]["drafter_s"] / res["arms"][a]["step_s"]
        res["arms"][a]["rollout_slowdown_vs_none"] = res["arms"][a]["rollout_s"] / mean("none", "rollout_s")
        res["arms"][a]["step_slowdown_vs_none"] = res["arms"][a]["step_s"] / mean("none", "step_s")
    res["per_step"] = recs
    return res


def print_table(res: dict) -> None:
    harness.print_table([{"arm": a, **r} for a, r in res["arms"].items()], {
        "arm": ("schedule", "s"), "step_s": ("step s", ".1f"), "rollout_s": ("rollout s", ".1f"),
        "update_policy_s": ("policy s", ".1f"), "drafter_s": ("drafter s", ".2f"), "drafter_steps": ("steps/RL", ".1f"),
        "drafter_share_of_step": ("drafter share", ".1%"), "rollout_slowdown_vs_none": ("rollout x", ".2f"),
        "step_slowdown_vs_none": ("step x", ".2f")})


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, steps=3, out_dir=True)
    ap.add_argument("--drafter-steps", type=int, default=4, help="budget of the sequential arm per RL step")
    args = ap.parse_args(argv)
    with harness.workdir(args.out_dir, "tlt-bench-schedules-") as out_dir:
        res = summarize(run(args.config, args.overrides, args.steps, args.drafter_steps, out_dir), args.steps,
                        args.drafter_steps)
    print_table(res)
    return harness.write_result(res, "schedules", args, argv)


if __name__ == "__main__":
    main()
