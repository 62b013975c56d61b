"""vLLM's draft length per batch-size tier, rollout by rollout: the bandit (StrategyTuner) and the spec guard.

vLLM picks its draft length K per step from the number of scheduled requests through a table (see
tlt/rollout/vllm_engine/vllm_worker.py: `Schedule`); tlt sets that table per tier (`rollout.tuner_buckets`)
before each rollout, without rebuilding the engine:

  - the bandit: the same `StrategyTuner` as the torch engine's, over chain arms K = 1..k (k: the
    depth the engine was built with, `rollout.strategy.depth`) plus the plain arm K = 0 when
    `rollout.tuner_plain_arm`. It chooses one arm per tier for the whole rollout (the torch engine
    chooses per round; vLLM's table cannot change within a step loop without a round trip) and is
    rewarded after it with that tier's exact throughput: tokens emitted (requests + drafts accepted,
    vLLM's per-step counters) over the seconds of the steps that ran with the arm's K;
  - the spec guard (tlt.rollout.guard): a tier it switched off gets K = 0 whatever the bandit says.
    It prices a tier's SD steps against the rollout's plain decode steps (prefills excluded).

Only tiers at or under the call's threshold draft at all (the tail switch). `spec/strategy/{bucket}`
counts steps per arm, as on the torch engine.
"""
from __future__ import annotations

from tlt.config import SpecStrategy
from tlt.rollout.guard import SpecGuard, StepLog
from tlt.rollout.stats import RolloutStats
from tlt.rollout.tuner import PLAIN, StrategyTuner

# A step record of the worker's step log: [requests before the step, drafts verified, tokens accepted,
# seconds, 1 if every request had been prefilled before it, K in effect (drafted at the step before)].
RUNNING, DRAFTS, ACCEPTED, SECONDS, DECODE, K_IN = range(6)


def chain_arms(k: int, plain: bool) -> list[SpecStrategy]:
    """Chains of depth 1..k, then the plain arm (K = 0) when `plain`."""
    return [SpecStrategy(depth=d, topk=1, tokens=d) for d in range(1, k + 1)] + ([PLAIN] if plain else [])


def vllm_tuner(cfg, k: int, seed: int = 0) -> StrategyTuner | None:
    """The bandit for a vLLM engine built with depth k (None when `rollout.tuner` is off)."""
    if not cfg.tuner or k < 1:
        return None
    buckets = sorted(cfg.tuner_buckets)
    return StrategyTuner([chain_arms(k, cfg.tuner_plain_arm) for _ in buckets], buckets, epsilon=cfg.tuner_epsilon,
                         seed=seed)


class TierPlan:
    """One rollout's K per tier (`tiers`: [[lowest batch size, K], ...] for the worker), and what
    the rollout taught: the bandit's rewards, the guard's verdict, the strategy counts."""

    def __init__(self, tuner: StrategyTuner | None, guard: SpecGuard | None, k: int, buckets: list[int]):
        self.tuner, self.guard = tuner, guard
        self.buckets = sorted(tuner.buckets if tuner is not None else buckets)
        self.arms = [tuner.choose(low) if tuner is not None else None for low in self.buckets]
        ks = [arm.depth if arm is not None else k for arm in self.arms]
        if guard is not None:
            ks = [0 if not guard.allows(low) else depth for low, depth in zip(self.buckets, ks)]
        self.tiers = [[low, depth] for low, depth in zip(self.buckets, ks)]

    def tier_of(self, batch_size: int) -> int:
        return max([i for i, low in enumerate(self.buckets) if batch_size >= low], default=0)

    def observe(self, step_log: list[list], threshold: int, stats: RolloutStats) -> None:
        """Reward each tier's arm, feed the guard, count strategies; decode steps only (no prefill)."""
        played = [arm is not None and arm.depth == k for arm, (_, k) in zip(self.arms, self.tiers)]
        tokens, seconds = [0] * len(self.buckets), [0.0] * len(self.buckets)
        log = StepLog()
        for rec in step_log:
            if not rec[DECODE]:
                continue
            tier = self.tier_of(rec[RUNNING])
            if rec[DRAFTS] and self.guard is not None:  # the guard's own tiers (a resumed bandit may differ)
                log.spec(self.guard.tier_of(rec[RUNNING]), rec[SECONDS], rec[DRAFTS], rec[DRAFTS] + rec[ACCEPTED])
            elif not rec[DRAFTS] and rec[K_IN] == 0:
                log.plain(rec[SECONDS])
            if played[tier] and rec[RUNNING] <= threshold and rec[K_IN] == self.tiers[tier][1]:
                tokens[tier] += rec[RUNNING] + rec[ACCEPTED]
                seconds[tier] += rec[SECONDS]
                stats.record_strategy(tier, self.tuner.arm_index(self.buckets[tier], self.arms[tier]))
        for tier, arm in enumerate(self.arms):
            if played[tier] and seconds[tier] > 0:
                self.tuner.update(self.buckets[tier], arm, tokens[tier] / seconds[tier], seconds=seconds[tier])
        if self.tuner is not None:
            stats.regret = self.tuner.regret_stats()
        if self.guard is not None:
            stats.guard_tripped = self.guard.observe(log)
