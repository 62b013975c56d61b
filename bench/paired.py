"""Paired mode of bench/rl_step.py (`--paired`): the arms' rollouts on the same weights and prompts.

Per-arm step means of separate runs mix the effect of SD with each run's own trajectory (after the
first update the arms' policies, samples and response lengths diverge). Here one pipeline trains
(the recipe's own config: tail switch, bandit, spot trainer; its own rollout feeds every update),
and before each of its steps the same engine, on the same weights, decodes that step's prompts once
per arm, back to back, the order rotating per step, with the step's seed:

    plain     SD off
    always    the recipe's fixed strategy at every step (the engine's fixed_strategy)
    static    the best draft length per tier of a sweep at the start (bench/baselines.py), no bandit
    adaptive  the engine as the run uses it (tail switch, bandit, guard), without the spot trainer; its
              prior and tail threshold priced from the start-up cost curve at the warm-started
              drafter's acceptance (`paired_priced`)

Per step and arm: rollout seconds, tokens generated, seconds per token; per arm the paired ratio
plain / arm per step with its mean and a 95 % t-interval over the steps (`paired_rollout_ratio`),
and the same for seconds per generated token (`paired_token_ratio`; arms may emit different lengths
when a sampled call draws other tokens); the run's bandit's regret summed over buckets after the last
step (`paired_regret_s`: its adaptive arm and the run's own rollouts). One engine per run (rollout.workers 1); either backend
(`--set rollout.backend=vllm`).
"""
import copy
import time

import numpy as np
from scipy import stats

import harness

baselines = harness.load("baselines")
ARMS = ("plain", "always", "static", "adaptive")


def interval(values: list[float], level: float = 0.95) -> dict:
    """Mean and two-sided t-interval (None with fewer than two values)."""
    x = np.asarray(values, float)
    if len(x) < 2:
        return {"mean": float(x.mean()) if len(x) else None, "ci_low": None, "ci_high": None, "n": int(len(x))}
    half = stats.t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return {"mean": float(x.mean()), "ci_low": float(x.mean() - half), "ci_high": float(x.mean() + half), "n": int(len(x))}


def decode_arm(engine, arm: str, prompts, cfg, table: dict, seed: int):
    """One rollout of `prompts` under `arm` (see the module doc) on `engine`."""
    r = cfg.rollout
    kw = dict(group_size=r.group_size, temperature=r.temperature, top_p=r.top_p, seed=seed)
    if arm == "plain":
        return engine.generate(prompts, spec=False, **kw)
    if arm == "always":
        with engine.fixed_strategy(r.strategy, batch_size=len(prompts) * r.group_size):
            return engine.generate(prompts, spec=True, **kw)
    if arm == "static":
        with baselines.static_schedule(engine, table, baselines.every_batch(cfg)):
            return engine.generate(prompts, spec=True, **kw)
    return engine.generate(prompts, spec=r.spec, **kw)


def step_arms(pipe, step: int, table: dict) -> dict:
    """Every arm on step `step`'s prompts (drawn from a copy of the run's sampler), the order rotating."""
    ctx, cfg = pipe.start_steps(), pipe.cfg
    rows = copy.deepcopy(ctx.sampler).next(cfg.rollout.prompts_per_step)
    prompts = ctx.encode(list(rows["prompt"]))
    out = {}
    for arm in harness.rotated(list(ARMS), step):
        t0 = time.perf_counter()
        batch = decode_arm(ctx.engine, arm, prompts, cfg, table, cfg.rl.seed * 100_003 + step)
        secs, tokens = time.perf_counter() - t0, sum(map(len, batch.response_ids))
        out[arm] = {"rollout_s": secs, "tokens": tokens, "s_per_token": secs / max(tokens, 1),
                    "accept_len": batch.stats.accept_len, "enabled_share": batch.stats.enabled_share}
        if arm == "adaptive" and batch.stats.regret is not None:  # the run's bandit, cumulative (its own rollouts too)
            out[arm]["regret_s"] = sum(batch.stats.regret.values())
    return out


def summarize(per_step: list[dict]) -> dict:
    """Paired ratios plain / arm per step (rollout seconds, seconds per token) with t-intervals."""
    res = {"paired_steps": per_step, "paired_rollout_ratio": {}, "paired_token_ratio": {}}
    for arm in ARMS[1:]:
        res["paired_rollout_ratio"][arm] = interval([s["plain"]["rollout_s"] / s[arm]["rollout_s"] for s in per_step])
        res["paired_token_ratio"][arm] = interval([s["plain"]["s_per_token"] / s[arm]["s_per_token"] for s in per_step])
    ad = res["paired_rollout_ratio"]["adaptive"]["mean"]
    res.update({f"paired_adaptive_vs_{b}": float(np.mean([s[b]["rollout_s"] / s["adaptive"]["rollout_s"]
                                                          for s in per_step])) for b in baselines.BASELINES})
    res["paired_adaptive_vs_plain"] = ad
    res["paired_regret_s"] = per_step[-1]["adaptive"].get("regret_s") if per_step else None  # summed over buckets
    return res


def run_paired(args, out_dir, extra: tuple = ()) -> dict:
    """The paired run (module doc): warm start, the static table's sweep, then per step the arms and the
    run's own RL step; returns `summarize`'s keys plus the table and the run's step records."""
    rl_step = harness.load("rl_step")
    cfg = harness.config(args, *extra, *rl_step.MODES["adaptive"],
                         *harness.run_overrides(out_dir, args.steps, "bench-paired"))
    per_step = []
    with harness.pipelines({"paired": cfg}) as pipes:
        pipe = pipes["paired"]
        pipe.warmstart()
        prompts = pipe.prompt_ids(pipe.dataset.heldout["prompt"])
        r = pipe.cfg.rollout
        table = baselines.sweep(pipe.engine, prompts, r.tuner_buckets, r.strategy.depth, args.sweep_tokens,
                                r.temperature, seed=pipe.cfg.rl.seed)
        for step in range(args.steps):
            arms = step_arms(pipe, step, table)
            s = pipe.rl_step(step)
            per_step.append(arms)
            print(f"step {step} paired: " + ", ".join(f"{a} {v['rollout_s']:.2f} s" for a, v in arms.items())
                  + f"; RL step {s.step_s:.1f} s", flush=True)
        cal = pipe.engine.calibration or {}  # what the adaptive arm started from (tlt.rollout.breakeven)
        priced = {"prior_accept_rate": cal.get("prior_accept_rate"), "tail_threshold": pipe.engine.threshold(),
                  "pays": cal.get("pays"), "break_even": cal.get("break_even")}
    return {**summarize(per_step), "paired_static_table": table, "paired_arms": list(ARMS), "paired_priced": priced}
