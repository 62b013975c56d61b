"""The field's baselines for tlt's tail switch + bandit, shared by bench/rl_step.py, bench/rollout.py and
bench/vllm_rollout.py (either engine):

    always   SD at every batch size with the recipe's fixed strategy (rollout.strategy): tuner off,
             spec guard off, no patience (what an engine with SD always on does)
    static   a fixed draft length per batch-size tier (rollout.tuner_buckets), no exploration: the best
             table of a calibration sweep on this machine (`sweep`), written into the result

Both decode with the warm-start drafter (no drafter training in the run), so that the `frozen` arm
(tail switch + bandit with the same drafter) isolates what the schedule is worth.
"""
import time

from tlt.config import SpecStrategy
from tlt.rollout import schedules
from tlt.rollout.tuner import StrategyTuner

BASELINES = ("always", "static")


def every_batch(cfg) -> int:
    """A threshold at or above any batch of the recipe's rollouts and evaluations: SD at every step."""
    r = cfg.rollout
    return max(r.prompts_per_step * r.group_size, cfg.eval.batch_size, 1)


def overrides(arm: str, cfg) -> list[str]:
    """Config overrides of a baseline arm (see the module doc); `static` also needs `install_static`."""
    if arm not in BASELINES:
        raise ValueError(f"unknown baseline arm {arm!r}; one of {', '.join(BASELINES)}")
    common = ["rollout.spec=true", "drafter.schedule=frozen", f"rollout.spec_threshold={every_batch(cfg)}",
              "rollout.spec_patience=0", "rollout.guard_patience=0"]
    # static: a tuner object to hold the table, not calibrated (the sweep replaces it)
    return common + (["rollout.tuner=false"] if arm == "always" else ["rollout.tuner=true", "rollout.tuner_calibrate=false"])


def config_update(arm: str, cfg) -> dict:
    """`overrides` as a RolloutConfig update (model_copy), for benches that build engines themselves."""
    return {k.removeprefix("rollout."): _value(v) for k, v in (o.split("=", 1) for o in overrides(arm, cfg))
            if k.startswith("rollout.")}


def _value(text: str):
    return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)


def chain(depth: int) -> SpecStrategy:
    return SpecStrategy(depth=depth, topk=1, tokens=depth)


def _tokens_per_s(engine, prompts, depth: int, max_new: int, temperature: float, seed: int) -> float:
    """Tokens per second of one call at this batch: plain (depth 0) or a fixed chain at every step."""
    t0 = time.perf_counter()
    if depth == 0:
        out = engine.generate(prompts, max_new_tokens=max_new, temperature=temperature, seed=seed, spec=False)
    else:
        with engine.fixed_strategy(chain(depth), batch_size=len(prompts)):
            out = engine.generate(prompts, max_new_tokens=max_new, temperature=temperature, seed=seed, spec=True)
    return sum(map(len, out.response_ids)) / (time.perf_counter() - t0)


def sweep(engine, prompts: list[list[int]], buckets: list[int], max_depth: int, max_new_tokens: int = 16,
          temperature: float = 0.7, reps: int = 1, seed: int = 0) -> dict:
    """The best fixed draft length per tier on this machine: at each tier's lowest batch size (prompts
    cycled), every depth 0..max_depth timed on the same prompts and seed (best of `reps`, depths
    interleaved); {"buckets", "depths" (the best per tier), "tokens_per_s" [tier][depth]}."""
    grid = []
    for low in sorted(buckets):
        batch = [prompts[i % len(prompts)] for i in range(low)]
        best = [0.0] * (max_depth + 1)
        for _ in range(reps):
            for d in range(max_depth + 1):
                best[d] = max(best[d], _tokens_per_s(engine, batch, d, max_new_tokens, temperature, seed))
        grid.append(best)
    return {"buckets": sorted(buckets), "depths": [max(range(len(row)), key=row.__getitem__) for row in grid],
            "tokens_per_s": grid, "max_new_tokens": max_new_tokens, "temperature": temperature}


def static_tuner(table: dict):
    """`sweep`'s table as the fixed schedule an engine is built with (`tuner=`)."""
    return StrategyTuner.static(table["buckets"], table["depths"])


def install_static(engine, table: dict) -> None:
    """The engine's bandit replaced by the fixed table of `sweep` (tlt.rollout.schedules)."""
    schedules.install_static(engine, table["buckets"], table["depths"])


def static_schedule(engine, table: dict, threshold: int):
    """`sweep`'s table in place of the engine's bandit for a block (tlt.rollout.schedules.static_schedule)."""
    return schedules.static_schedule(engine, table["buckets"], table["depths"], threshold)
