"""Bucketed epsilon-greedy bandit over speculative strategies (TLT mechanism 3, "BEG-MAB").

Batch sizes fall into buckets by lower bound (default 1, 2, 5, 21). Each bucket has its own arms
(depth x topk x tokens); longer drafts for smaller batches, as in TLT's 48/32/16/8 tokens, scaled
down to chains for CPU (see `_DEFAULT_TABLE`); optionally a plain-decoding arm (`PLAIN`), so a bucket where drafting costs more
than it saves learns to turn SD off. Reward of one round = tokens emitted (accept length x batch size) / round time;
an arm's value is the median of its last `window` rewards, with its prior (one predicted reward per arm,
set by the start-up calibration, tlt.rollout.breakeven) counted as one of them. Untried arms (no
reward, no prior) are played first.

Regret (`regret()`, logged as `spec/regret/{bucket}` and `spec/regret`): per bucket, the seconds the
bandit's choices took minus the seconds the best arm in hindsight would have taken to emit the same
tokens. Every timed update adds its seconds and tokens (reward x seconds) to its arm's totals; the best
arm is the one with the highest total throughput (tokens / seconds), so regret = sum of the arms' seconds
- sum of their tokens / that throughput (0 when only one arm was ever played).
"""
from __future__ import annotations

import random
import statistics
from collections import deque

from tlt.config import SpecStrategy

# (depth, topk, tokens) per bucket, smallest batches first; the last row serves any later bucket.
# Shaped to a CPU's cost curve (measured: a verify of M tokens ~ 40 ms + 6.25 ms * M on 2 cores):
# every verified token costs ~0.14 of a step, so short chains only, shorter as the batch grows
# (trees of 10-17 tokens need accept lengths of 2.4-3.2 just to break even there). A GPU, where
# a verified token costs ~0.01-0.02 of a step, wants TLT's wide trees: pass your own `arms`.
_DEFAULT_TABLE = [
    [(2, 1, 2), (3, 1, 3), (4, 1, 4), (5, 1, 5)],
    [(1, 1, 1), (2, 1, 2), (3, 1, 3)],
    [(1, 1, 1), (2, 1, 2)],
    [(1, 1, 1), (2, 1, 2)],
]


# Model-free n-gram arms per bucket (source ngram: drafts from the group's own rollouts, see
# ngram.py). Drafting is free, so only verify cost counts: longer chains, and a 2-way tree where
# the group's samples disagree; the last row serves any later bucket.
_NGRAM_TABLE = [
    [(4, 1, 4), (8, 1, 8), (6, 2, 8)],
    [(3, 1, 3), (6, 1, 6)],
    [(2, 1, 2), (4, 1, 4)],
    [(2, 1, 2)],
]

PLAIN = SpecStrategy(depth=0, topk=1, tokens=0)  # the "no SD" arm: one plain decode step


def default_arms(buckets: list[int], plain: bool = False, ngram: bool = False) -> list[list[SpecStrategy]]:
    """Arms per bucket from `_DEFAULT_TABLE` (bucket i uses row min(i, last)); `ngram` adds the
    model-free n-gram arms of `_NGRAM_TABLE`; `plain` adds the no-SD arm to every bucket, so the
    bandit can switch SD off where drafting does not pay."""
    def row(table, i, source):
        return [SpecStrategy(depth=d, topk=k, tokens=t, source=source) for d, k, t in table[min(i, len(table) - 1)]]
    return [row(_DEFAULT_TABLE, i, "drafter") + (row(_NGRAM_TABLE, i, "ngram") if ngram else [])
            + ([PLAIN] if plain else []) for i in range(len(buckets))]


def _zero_totals(arms: list[list[SpecStrategy]]) -> list[list[list[float]]]:
    return [[[0.0, 0.0] for _ in bucket] for bucket in arms]


def _key(s: SpecStrategy) -> tuple[int, int, int, str]:
    return (s.depth, s.topk, s.tokens, s.source)


class StrategyTuner:
    """choose(batch_size) -> SpecStrategy; update(batch_size, arm, reward); state()/load_state()."""

    def __init__(self, arms: list[list[SpecStrategy]] | None = None, buckets: list[int] | None = None,
                 epsilon: float = 0.1, seed: int = 0, window: int = 300):
        self.buckets = sorted(buckets or [1, 2, 5, 21])
        self.arms = arms if arms is not None else default_arms(self.buckets)
        if len(self.arms) != len(self.buckets) or not all(self.arms):
            raise ValueError(f"need a non-empty arm list per bucket: {len(self.buckets)} buckets, "
                             f"{len(self.arms)} arm lists")
        self.epsilon, self.window = epsilon, window
        self.rng = random.Random(seed)
        self.rewards = [[deque(maxlen=window) for _ in arms] for arms in self.arms]
        self.prior: list[list[float]] | None = None  # per bucket, per arm: a predicted reward (tlt.rollout.breakeven.seed)
        self.spent = _zero_totals(self.arms)  # per bucket, per arm: [seconds, tokens] of timed updates

    @classmethod
    def default(cls, buckets: list[int] | None = None, epsilon: float = 0.1, seed: int = 0,
                window: int = 300, plain: bool = False, ngram: bool = False) -> "StrategyTuner":
        """The default arms (`default_arms`) over `buckets`."""
        buckets = sorted(buckets or [1, 2, 5, 21])
        return cls(default_arms(buckets, plain, ngram), buckets, epsilon=epsilon, seed=seed, window=window)

    @classmethod
    def static(cls, buckets: list[int], depths: list[int]) -> "StrategyTuner":
        """A fixed schedule, no bandit: bucket i always drafts a chain of depths[i] (0: plain decoding).
        The baseline the bandit is measured against (bench/: the `static` arm)."""
        if len(depths) != len(buckets) or min(depths, default=0) < 0:
            raise ValueError(f"need one depth >= 0 per bucket: {len(buckets)} buckets, depths {depths}")
        arms = [[SpecStrategy(depth=d, topk=1, tokens=d) if d else PLAIN] for d in depths]
        return cls(arms, sorted(buckets), epsilon=0.0)

    @classmethod
    def from_config(cls, r, seed: int = 0) -> "StrategyTuner":
        """The default arms for a `RolloutConfig` (its buckets, epsilon, plain and n-gram arms)."""
        return cls.default(r.tuner_buckets, epsilon=r.tuner_epsilon, seed=seed, plain=r.tuner_plain_arm,
                           ngram=r.tuner_ngram_arms)

    def bucket_of(self, batch_size: int) -> int:
        """Index of the bucket with the largest lower bound <= batch_size (bucket 0 below the first)."""
        idx = 0
        for i, low in enumerate(self.buckets):
            if batch_size >= low:
                idx = i
        return idx

    def arm_index(self, batch_size: int, arm: SpecStrategy) -> int:
        keys = [_key(a) for a in self.arms[self.bucket_of(batch_size)]]
        return keys.index(_key(arm))

    def values(self, bucket: int) -> list[float | None]:
        """Median reward per arm of a bucket, the prior counted as one (None = never tried, no prior)."""
        prior = self.prior[bucket] if self.prior is not None else [None] * len(self.rewards[bucket])
        return [statistics.median([*r, *([p] if p is not None else [])]) if r or p is not None else None
                for r, p in zip(self.rewards[bucket], prior)]

    def best(self, batch_size: int) -> SpecStrategy:
        b = self.bucket_of(batch_size)
        vals = self.values(b)
        scored = [(v, i) for i, v in enumerate(vals) if v is not None]
        return self.arms[b][max(scored)[1] if scored else 0]

    def choose(self, batch_size: int) -> SpecStrategy:
        b = self.bucket_of(batch_size)
        vals = self.values(b)
        untried = [i for i, v in enumerate(vals) if v is None]
        if untried:
            return self.arms[b][untried[0]]
        if self.rng.random() < self.epsilon:
            return self.arms[b][self.rng.randrange(len(vals))]
        return self.arms[b][max(range(len(vals)), key=lambda i: vals[i])]

    def update(self, batch_size: int, arm: SpecStrategy, reward: float, seconds: float | None = None) -> None:
        """One play's reward (tokens per second); `seconds` it took, for the regret (None: not counted)."""
        b, i = self.bucket_of(batch_size), self.arm_index(batch_size, arm)
        self.rewards[b][i].append(float(reward))
        if seconds is not None and seconds > 0:
            self.spent[b][i][0] += float(seconds)
            self.spent[b][i][1] += float(reward) * float(seconds)

    def regret(self) -> list[float]:
        """Per bucket: seconds spent minus the seconds the best arm in hindsight (highest total tokens /
        seconds) would have taken for the same tokens; 0.0 where nothing was timed."""
        out = []
        for totals in self.spent:
            played = [(s, t) for s, t in totals if s > 0]
            best = max((t / s for s, t in played), default=0.0)
            out.append(sum(s for s, _ in played) - sum(t for _, t in played) / best if best > 0 else 0.0)
        return out

    def regret_stats(self) -> dict[str, float]:
        """`regret()` keyed by bucket index as a string (RolloutStats.regret)."""
        return {str(b): r for b, r in enumerate(self.regret())}

    def state(self) -> dict:
        """JSON-able snapshot (arms, reward windows, RNG) for logging and checkpoints."""
        version, internal, gauss = self.rng.getstate()
        return {"buckets": list(self.buckets), "epsilon": self.epsilon, "window": self.window,
                "arms": [[a.model_dump() for a in arms] for arms in self.arms],
                "rewards": [[list(r) for r in bucket] for bucket in self.rewards], "prior": self.prior,
                "best": [self.arm_index(low, self.best(low)) for low in self.buckets],
                "spent": [[list(a) for a in bucket] for bucket in self.spent],
                "rng": [version, list(internal), gauss]}

    def load_state(self, state: dict) -> None:
        self.buckets = list(state["buckets"])
        self.epsilon, self.window = float(state["epsilon"]), int(state["window"])
        self.arms = [[SpecStrategy(**a) for a in arms] for arms in state["arms"]]
        self.rewards = [[deque(r, maxlen=self.window) for r in bucket] for bucket in state["rewards"]]
        self.prior = state.get("prior")  # checkpoints from before the prior was kept apart: none
        # checkpoints from before the regret was kept restart its totals at zero
        self.spent = [[list(map(float, a)) for a in bucket] for bucket in state["spent"]] if "spent" in state \
            else _zero_totals(self.arms)
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
