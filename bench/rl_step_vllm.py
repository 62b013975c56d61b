"""vLLM arms of bench/rl_step.py: the same three tlt GRPO loops with `rollout.backend=vllm`.

    vllm_plain    no SD, no drafter training
    vllm_spec     tail SD (vLLM's batch-size schedule, the bandit per tier, the spec guard) and
                  the spot trainer in the rollout's tail, its drafter reloaded in place
    vllm_frozen   tail SD with the warm-start drafter only
    vllm_always, vllm_static   the baselines of bench/baselines.py (--baselines), on vLLM

Run by bench/rl_step.py after its torch-engine arms whenever the vLLM venv exists (`--no-vllm`
skips them), on the same config, prompts and seed, interleaved step by step like those (the order
rotates every step). Means over steps 1..N-1 as there. Keys it adds to the result:
step_s_vllm_{plain,spec,frozen}, rollout_s_vllm_{plain,spec}, rollout_speedup_vllm (vLLM plain over
vLLM tail SD, rollout), speedup_vllm_vs_torch_plain (the torch engine's plain step over the best
vLLM step), speedup_vllm_vs_torch (best torch-engine step over best vLLM step), greedy identity with
SD forced on vs off on vLLM, and the engines' rebuild count (0 expected); `speedup_vs_trl` becomes
TRL's step over the best tlt step of any arm. With the baselines: step_s_vllm_{always,static},
rollout_s_vllm_{always,static}, speedup_vllm_vs_{always,static} (a baseline's step over vllm_spec's;
rollout_speedup_vllm_vs_* the rollout's) and the vLLM static arm's sweep, `static_table_vllm`.
"""
import harness

ARMS = {"plain": "vllm_plain", "adaptive": "vllm_spec", "frozen": "vllm_frozen", "always": "vllm_always",
        "static": "vllm_static"}  # rl_step's mode -> arm


def available() -> bool:
    """A vLLM interpreter exists ($TLT_VLLM_PYTHON or .venv-vllm), as the backend looks for one."""
    from tlt.rollout.vllm_engine.process import VllmUnavailable, vllm_python

    try:
        vllm_python()
    except VllmUnavailable:
        return False
    return True


def run_vllm(args, out_dir) -> dict:
    """bench/rl_step.py's three runs on `rollout.backend=vllm`, interleaved; per-arm records and end results."""
    out = harness.load("rl_step").run_modes(args, out_dir, ("rollout.backend=vllm", "rollout.workers=1"), ARMS)
    runs = out["runs"]
    for run in runs.values():
        run["rebuilds"] = max(s["rebuilds"] or 0.0 for s in run["steps"])
        run["guard_tripped"] = max(s["guard_tripped"] or 0.0 for s in run["steps"])
    return {**runs, "same_warmstart_drafter": out["same_warmstart_drafter"], "static_table": out["static_table"]}


def merge(res: dict, runs: dict | None) -> dict:
    """Add the vLLM keys to bench/rl_step.py's result `res` (None: the vLLM arms did not run)."""
    mean = harness.mean_excluding_first
    torch_steps = [res["step_s_plain"], res["step_s_spec"], res["step_s_frozen"]]
    best = min(torch_steps)
    if runs is not None:
        arms = [a for a in ARMS.values() if a in runs]
        step = {a: mean([s["step_s"] for s in runs[a]["steps"]]) for a in arms}
        roll = {a: mean([s["rollout_s"] for s in runs[a]["steps"]]) for a in arms}
        best_vllm = min(step[a] for a in ("vllm_plain", "vllm_spec", "vllm_frozen"))  # the torch side's three arms
        for a in arms[3:]:  # the baselines that ran
            res.update({f"step_s_{a}": step[a], f"rollout_s_{a}": roll[a]})
        res.update(harness.load("rl_step").baseline_keys(step, roll, "vllm_spec", "vllm_"))
        res["static_table_vllm"] = runs.get("static_table")
        res.update({"step_s_vllm_plain": step["vllm_plain"], "step_s_vllm_spec": step["vllm_spec"],
                    "step_s_vllm_frozen": step["vllm_frozen"], "rollout_s_vllm_plain": roll["vllm_plain"],
                    "rollout_s_vllm_spec": roll["vllm_spec"], "rollout_s_vllm_frozen": roll["vllm_frozen"],
                    "rollout_speedup_vllm": roll["vllm_plain"] / roll["vllm_spec"],
                    "speedup_vllm_vs_torch_plain": res["step_s_plain"] / best_vllm,
                    "speedup_vllm_vs_torch": best / best_vllm,
                    "vllm_rebuilds": max(runs[a]["rebuilds"] for a in arms),
                    "vllm_guard_tripped": max(runs[a]["guard_tripped"] for a in arms),
                    "vllm_greedy_eval_identical": bool(runs["vllm_spec"]["greedy_identical"]
                                                       and runs["vllm_frozen"]["greedy_identical"]),
                    "vllm_same_warmstart_drafter": runs["same_warmstart_drafter"],
                    "vllm": {a: runs[a] for a in arms}})
        best = min(best, best_vllm)
    if res.get("trl"):
        res["speedup_vs_trl"] = res["trl"]["step_s"] / best  # the best tlt step of any arm
    res["speedup_vs_trl_what"] = "TRL's GRPOTrainer step over the best tlt step (torch-engine and vLLM arms)"
    return res


if __name__ == "__main__":
    raise SystemExit("run bench/rl_step.py: it runs these arms after its own")
