"""Calibrate before exploring (`rollout.tuner_calibrate`): the cost curve of this machine, the break-even
accept length per batch-size tier, and the bandit seeded from them.

At engine start, a few short calls per tier at the rollout temperature (`rollout.tuner_buckets`, at the
tier's lowest batch size, on random prompts) time one decode step (depth 0) and one SD round at the shallowest and the
deepest chain the tier's arms draft (the engine's `fixed_strategy`: draft + verify, every step a
round); the depths between are interpolated. A round of depth
d emits at most d + 1 tokens per row where a plain step emits 1, so the tier's break-even accept length
for depth d is round_s[d] / round_s[0]; SD can pay at d only if that is below d + 1 (every draft
accepted). The bandit (StrategyTuner) then starts with one predicted reward per arm instead of
playing every untried arm first: plain decoding b / round_s[0], a chain b * E[accept] / round_s[d],
E[accept] = 1 + a + ... + a^d at the prior per-token acceptance a = PRIOR_ACCEPT_RATE. So a tier where
no depth can pay starts on the plain arm and tries SD only when it explores (rate epsilon); the other
tiers start at the depth the curve favours. Real rewards join each arm's window and take over.

The tail threshold (`rollout.spec_threshold: auto`, the default) comes from the same curve: SD runs
while at most `tail_threshold` sequences decode, the upper edge of the widest run of tiers, from the
smallest batch up, in which some SD arm's predicted reward beats plain decoding's by PAY_MARGIN at the
prior acceptance (0: SD pays in no tier, it never runs; the last tier pays: no bound). An engine without a
curve (calibration off, no bandit) uses DEFAULT_THRESHOLD; a number in the config is used as it is.
The torch engine caps `auto` at DEFAULT_THRESHOLD (its `auto_cap`): its short calibration calls price
mid-rollout rounds at 5+ sequences too cheaply (measured on both recipes: the curve predicted SD paying
at every batch size at the warm-started drafter's acceptance, while SD at 5+ sequences ran slower than
plain in the rollouts: paired conf/longtail.yaml 0.84x plain at the first step, conf/default.yaml
0.91x), so there the curve only lowers the threshold, where SD cannot pay even in a small tail. vLLM's
curve agreed with its rollouts (conf/longtail.yaml: SD paying up to every batch size) and is uncapped.

Once the run knows its drafter (after the warm-start, or a champion's load), the prior is re-priced
from what the drafter measured: the held-out accept length at the rollout temperature, with the fixed
`drafter.eval_strategy` chain, gives the per-token rate (`rate_of`), and `reprice` seeds the bandit
and moves the threshold with it (the engines' `set_accept_prior`). A drafter that accepts too little
on sampled text to pay on this machine so starts the run with SD off (threshold 0: not explored until
a later pricing, at an evaluation, says it pays).

Each engine calibrates once, when it is built (the driver's, every pool worker's, every Ray actor's,
on the cores it decodes on). Not again after a policy update or a drafter refresh: the curve is the
cost of forwards of fixed shapes, which new weights of the same architecture do not change; what
they change is acceptance, which the bandit's windowed rewards track from the next round on.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from tlt.config import SpecStrategy
from tlt.rollout.tuner import PLAIN, StrategyTuner

# Per-token acceptance assumed before any round is verified (a warm-started drafter on its own policy's
# text accepts ~0.5-0.8 per position on the recipes; its rewards replace this as rounds are played).
PRIOR_ACCEPT_RATE = 0.6
DEFAULT_THRESHOLD = 8  # `spec_threshold: auto` on an engine without a measured curve
# A tier pays for the tail threshold when some SD arm is predicted this much faster than plain decoding: the
# curve's short calls price rounds within ~5 % of a real rollout's (conf/default.yaml, batch 21, depth 1:
# break-even 1.47-1.54 from the calibration, 1.53 from bench/baselines.py's sweep on held-out prompts).
PAY_MARGIN = 0.05
NO_BOUND = 1 << 20  # a tail threshold above any batch: SD at every batch size


def expected_accept(depth: int, rate: float) -> float:
    """Mean tokens per row of a chain round of `depth` drafts when each is accepted with `rate` (given
    the ones before it were): 1 + rate + ... + rate^depth."""
    return sum(rate ** i for i in range(depth + 1))


def rate_of(accept_len: float, depth: int) -> float:
    """The per-token acceptance at which a depth-`depth` chain emits `accept_len` tokens per round
    (`expected_accept`'s inverse on [0, 1]; accept lengths outside [1, depth + 1] are clamped)."""
    if depth < 1:
        raise ValueError(f"rate_of needs a drafting depth >= 1, got {depth}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accept(depth, mid) < accept_len else (lo, mid)
    return (lo + hi) / 2


@dataclass
class CostCurve:
    """round_s[tier][d]: seconds of one decode step (d = 0) or one SD round of a depth-d drafter chain at
    the tier's lowest batch size, None where not measured; ngram_s[tier][d] the same for n-gram chains
    (no drafter forwards), where the tier has n-gram arms. Trees are priced as chains of their depth."""

    buckets: list[int]
    round_s: list[list[float | None]]
    seconds: float = 0.0  # what measuring took
    ngram_s: list[list[float | None]] | None = None

    def _at(self, tier: int, depth: int, source: str = "drafter") -> tuple[int, float]:
        """The measured depth closest to `depth` from below (deeper arms than measured: the deepest) and its time."""
        if source == "ngram" and self.ngram_s:  # n-gram chains where measured, else priced as drafter chains
            found = [i for i, s in enumerate(self.ngram_s[tier][:depth + 1]) if i and s is not None]
            if found:
                return found[-1], self.ngram_s[tier][found[-1]]
        row = self.round_s[tier]
        d = max(i for i, s in enumerate(row[:depth + 1]) if s is not None)
        return d, row[d]

    def break_even(self, tier: int, depth: int, source: str = "drafter") -> float:
        """Accept length (tokens per row and round) at which a depth-`depth` round pays as much as plain steps."""
        return self._at(tier, depth, source)[1] / self.round_s[tier][0]

    def can_pay(self, tier: int) -> bool:
        """Some measured depth breaks even below its reachable accept length (depth + 1)."""
        rows = [self.round_s[tier]] + ([self.ngram_s[tier]] if self.ngram_s else [])
        return any(s is not None and s / self.round_s[tier][0] < d + 1 for row in rows for d, s in enumerate(row) if d)

    def predicted_reward(self, tier: int, arm: SpecStrategy, rate: float = PRIOR_ACCEPT_RATE) -> float:
        """Tokens per second the bandit would measure for `arm` in `tier` (its reward's unit)."""
        b = self.buckets[tier]
        if arm.plain:
            return b / self.round_s[tier][0]
        d, s = self._at(tier, arm.depth, arm.source)
        return b * expected_accept(d, rate) / s

    def pays(self, tier: int, arms: list[SpecStrategy], rate: float) -> bool:
        """Some SD arm of the tier is predicted to emit PAY_MARGIN more tokens per second than plain decoding."""
        plain = self.predicted_reward(tier, PLAIN) * (1 + PAY_MARGIN)
        return any(self.predicted_reward(tier, a, rate) > plain for a in arms if not a.plain)

    def tail_threshold(self, arms: list[list[SpecStrategy]], rate: float) -> int:
        """`spec_threshold: auto` (see the module doc): the largest batch size of the widest run of
        paying tiers from the smallest up; 0 when the first tier does not pay, NO_BOUND when all do."""
        return self.threshold_of([self.pays(t, arms[t], rate) for t in range(len(self.buckets))])

    def threshold_of(self, pays: list[bool]) -> int:
        """The tail threshold of the tiers' `pays` verdicts (see `tail_threshold`)."""
        first_off = next((t for t, ok in enumerate(pays) if not ok), None)
        return NO_BOUND if first_off is None else self.buckets[first_off] - 1 if first_off else 0

    @classmethod
    def from_summary(cls, summary: dict) -> "CostCurve":
        """The curve back from `summary()` (an engine keeps the summary)."""
        return cls(list(summary["buckets"]), summary["round_s"], summary.get("seconds", 0.0), summary.get("ngram_s"))

    def summary(self) -> dict:
        """JSON-able: the curves, break-even per tier and measured depth, which tiers can pay, seconds."""
        def ratios(rows):
            return [[None if s is None or not d else s / base[0] for d, s in enumerate(row)]
                    for row, base in zip(rows, self.round_s)]
        return {"buckets": self.buckets, "round_s": self.round_s, "ngram_s": self.ngram_s, "seconds": self.seconds,
                "break_even": ratios(self.round_s), "break_even_ngram": ratios(self.ngram_s) if self.ngram_s else None,
                "can_pay": [self.can_pay(t) for t in range(len(self.buckets))]}


def _chain(depth: int, source: str = "drafter") -> SpecStrategy:
    return SpecStrategy(depth=depth, topk=1, tokens=depth, source=source)


def _step_s(engine, prompts: list[list[int]], depth: int, new_tokens: int, source: str = "drafter",
            temperature: float = 0.0) -> float:
    """Seconds per decode step (depth 0) or SD round of one call at `temperature`, prefill excluded where
    the engine times it (the torch engine); vLLM counts its prefill as one of the call's steps."""
    kw = dict(max_new_tokens=new_tokens, temperature=temperature, seed=0)
    if depth == 0:
        out = engine.generate(prompts, spec=False, **kw)
    else:
        sources = engine.capabilities.sources  # an arm's source the engine drafts from, else its own (vLLM n-gram)
        with engine.fixed_strategy(_chain(depth, source if source in sources else min(sources)), len(prompts)):
            out = engine.generate(prompts, spec=True, **kw)
    s = out.stats
    if s.vllm is not None:
        return s.time_s / max(1, s.decode_steps)
    return (s.time_s - s.prefill_s) / max(1, s.decode_steps + s.spec_steps)


def measure(engine, tuner: StrategyTuner, vocab_size: int, prompt_len: int = 8, new_tokens: int = 4,
            seed: int = 0, temperature: float = 0.0) -> CostCurve:
    """The curve at the tuner's tiers: the plain step, and per draft source the shallowest and deepest
    chain among the tier's arms; the depths between are interpolated (a round's cost is linear in its
    depth: d drafter forwards and d + 1 verified tokens per row). Each tier's batch is warmed up first
    (a batch size's first call pays one-off allocations, which would inflate the plain step). Calls run
    at `temperature`, the rollout's: sampling and rejection sampling have their own cost."""
    t0, rng = time.perf_counter(), random.Random(seed)
    prompts = [[rng.randrange(3, max(4, min(vocab_size, 4096))) for _ in range(prompt_len)]
               for _ in range(max(tuner.buckets))]
    rows, ngram = [], []
    for tier, low in enumerate(tuner.buckets):
        _step_s(engine, prompts[:low], 0, 2, temperature=temperature)  # warm-up at this batch size
        plain = _step_s(engine, prompts[:low], 0, new_tokens, temperature=temperature)
        for source, out in (("drafter", rows), ("ngram", ngram)):
            depths = sorted({a.depth for a in tuner.arms[tier] if not a.plain and a.source == source})
            row: list[float | None] = [None] * (max(depths, default=0) + 1)
            row[0] = plain if source == "drafter" else None
            if depths:
                lo, hi = depths[0], depths[-1]
                ends = {d: _step_s(engine, prompts[:low], d, new_tokens, source, temperature) for d in {lo, hi}}
                for d in depths:
                    row[d] = ends[lo] + (ends[hi] - ends[lo]) * (d - lo) / (hi - lo) if hi > lo else ends[lo]
            out.append(row)
    has_ngram = any(s is not None for row in ngram for s in row)
    return CostCurve(list(tuner.buckets), rows, time.perf_counter() - t0, ngram if has_ngram else None)


def seed(tuner: StrategyTuner, curve: CostCurve, rate: float = PRIOR_ACCEPT_RATE) -> None:
    """One predicted reward per arm and tier, the bandit's prior (see the module doc), so no arm counts
    as untried; a later call replaces it (real rewards are kept)."""
    tuner.prior = [[curve.predicted_reward(tier, arm, rate) for arm in arms] for tier, arms in enumerate(tuner.arms)]


def reprice(tuner: StrategyTuner, calibration: dict, rate: float) -> dict:
    """Seed `tuner` from the engine's curve (its `calibration`) at per-token acceptance `rate`; the
    calibration with the rate and the tail threshold that follow (what the engine keeps)."""
    curve = CostCurve.from_summary(calibration)
    seed(tuner, curve, rate)
    pays = [curve.pays(t, arms, rate) for t, arms in enumerate(tuner.arms)]
    return {**calibration, "prior_accept_rate": rate, "tail_threshold": curve.threshold_of(pays), "pays": pays}


def calibrate(engine, tuner: StrategyTuner, vocab_size: int, temperature: float = 0.0) -> dict:
    """`measure` on `engine` at `temperature`, then seed its bandit at PRIOR_ACCEPT_RATE; the curve's summary
    with the prior and its tail threshold (`reprice`; kept by the engine, for reports and the threshold)."""
    return reprice(tuner, measure(engine, tuner, vocab_size, temperature=temperature).summary(), PRIOR_ACCEPT_RATE)


def tail_threshold(configured: int | str, calibration: dict | None, cap: int | None = None) -> int:
    """The tail threshold an engine decodes with: `rollout.spec_threshold` when it is a number; for
    `auto`, the calibration's (`reprice`) up to the engine's `cap`, or DEFAULT_THRESHOLD on an engine
    without a calibration."""
    if configured != "auto":
        return int(configured)
    if not calibration or "tail_threshold" not in calibration:  # no curve, or one never priced
        return DEFAULT_THRESHOLD
    return min(int(calibration["tail_threshold"]), cap if cap is not None else NO_BOUND)


def calibrated(engine, tuner: StrategyTuner | None, r, vocab_size: int):
    """`engine`, its bandit `tuner` calibrated first when `rollout.tuner_calibrate` (with SD on and a bandit);
    `engine.calibration`: the curve's summary (None when not calibrated)."""
    engine.calibration = calibrate(engine, tuner, vocab_size, r.temperature) \
        if r.spec and r.tuner_calibrate and tuner else None
    return engine
