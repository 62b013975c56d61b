"""When to train the drafter on a CPU box: what each refresh schedule delivers per RL step.

    python bench/schedules.py conf/default.yaml --steps 3 --json out.json [--drafter-steps 4] [--set k=v ...]

Arms, one Pipeline each, interleaved step by step (rotating who goes first), same seed, prompts
and warm-started drafter (a cache hit after the first), SD on in the rollout tail as configured:
  none        no drafter training (`drafter.refresh_every: 0`): the rollout and step without it
  spot        the spot trainer process trains during the rollout's tail (`drafter.spot: true`)
  sequential  a fixed budget of `--drafter-steps` drafter steps after the policy update
              (`drafter.spot: false`, `drafter.refresh_steps`)
Per arm (means over steps 1..N-1, step 0 excluded: the buffer is empty there): drafter steps per
RL step, drafter seconds inside the step, rollout and step seconds, and the rollout's slowdown
against `none` (the spot trainer competes with decoding for the same 2 cores).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ARMS = {"none": ["drafter.refresh_every=0", "drafter.spot=false"],
        "spot": ["drafter.spot=true", "drafter.refresh_every=1"],
        "sequential": ["drafter.spot=false", "drafter.refresh_every=1"]}


def arm_config(config, overrides, arm: str, steps: int, drafter_steps: int, out_dir: Path):
    from tlt.config import load_config

    base = [f"trainer.checkpoint_dir={out_dir / arm}", f"trainer.checkpoint_every={10 ** 6}",
            "tracking.samples_every=0", f"rl.steps={steps + 1}", f"drafter.refresh_steps={drafter_steps}"]
    return load_config(config, base + list(overrides) + ARMS[arm])


def record(m: dict, prev_steps: float) -> dict:
    return {"step_s": m["timing_s/step"], "rollout_s": m.get("timing_s/rollout", 0.0),
            "update_policy_s": m.get("timing_s/update_policy", 0.0),
            "drafter_s": m.get("timing_s/update_drafter", 0.0),
            "drafter_steps": m.get("drafter/steps", prev_steps) - prev_steps,
            "spec_enabled_share": m.get("spec/enabled_share", 0.0), "tail_share": m.get("rollout/tail_share", 0.0),
            "accept_len": m.get("spec/accept_len/mean")}


def run(config, overrides, steps: int, drafter_steps: int, out_dir: Path) -> dict:
    from tlt.pipeline import Pipeline

    pipes = {a: Pipeline(arm_config(config, overrides, a, steps, drafter_steps, out_dir)) for a in ARMS}
    for p in pipes.values():
        p.validate_data()
        p.prepare()
        p.warmstart()
    recs: dict[str, list[dict]] = {a: [] for a in ARMS}
    totals = {a: 0.0 for a in ARMS}
    order = list(ARMS)
    try:
        for step in range(steps):
            for a in order[step % len(order):] + order[: step % len(order)]:
                s = pipes[a].rl_step(step)
                recs[a].append(record(s.metrics, totals[a]))
                totals[a] = s.metrics.get("drafter/steps", totals[a])
                r = recs[a][-1]
                print(f"step {step} {a:>10}: {r['step_s']:6.1f} s, rollout {r['rollout_s']:5.1f} s, drafter "
                      f"{r['drafter_steps']:.0f} steps / {r['drafter_s']:.2f} s", flush=True)
    finally:
        for p in pipes.values():
            p.close()
    del pipes
    gc.collect()
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
    print(f"\n{'schedule':>10} {'step s':>7} {'rollout s':>9} {'policy s':>8} {'drafter s':>9} {'steps/RL':>8} "
          f"{'drafter %':>9} {'rollout x':>9} {'step x':>7}")
    for a, r in res["arms"].items():
        print(f"{a:>10} {r['step_s']:>7.1f} {r['rollout_s']:>9.1f} {r['update_policy_s']:>8.1f} {r['drafter_s']:>9.2f} "
              f"{r['drafter_steps']:>8.1f} {100 * r['drafter_share_of_step']:>8.1f}% {r['rollout_slowdown_vs_none']:>9.2f} "
              f"{r['step_slowdown_vs_none']:>7.2f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--drafter-steps", type=int, default=4, help="budget of the sequential arm per RL step")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="tlt-bench-schedules-"))
    try:
        res = summarize(run(args.config, args.overrides, args.steps, args.drafter_steps, out_dir), args.steps,
                        args.drafter_steps)
        res["command"] = " ".join(["python bench/schedules.py", *(argv if argv is not None else sys.argv[1:])])
    finally:
        if args.out_dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    print_table(res)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
