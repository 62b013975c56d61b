"""The rollout floor's contract: `Engine` (what every engine does: the torch engine, the worker
pool, vLLM, Ray actors), its tail hook, what an engine can do (`Capabilities`, the `capabilities`
property of every engine), and the one check that turns a call an engine cannot honour into an
error with the reason.

Where a backend cannot do
something a call asks for (a tree strategy on vLLM, speculation on an engine built without a
drafter, a fixed-strategy measurement on a worker pool), the call raises `EngineCapabilityError`
naming what is missing instead of decoding some other way.

`fixed_config` is the rollout config of a fixed-strategy measurement (the held-out accept length,
tlt.rollout.acceptance.measure_accept), which each engine applies to itself in `fixed_strategy`.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from tlt.config import RolloutConfig, SpecStrategy
from tlt.rollout.breakeven import reprice, tail_threshold

if TYPE_CHECKING:
    from tlt.rollout.batch import RolloutBatch


class EngineCapabilityError(ValueError):
    """A call asks an engine for something it cannot do; the message says what and why."""


@dataclass(frozen=True)
class Capabilities:
    """What one engine supports, read from its code and how it was built.

    name: the engine in words, for error messages. spec: a `spec=True` call speculates (False: the
    engine was built without a drafter and cannot get one). per_call_spec: `generate`'s `spec` and
    `spec_threshold` are honoured per call. tail_switch: SD runs only once <= the threshold sequences
    run, and `on_tail` fires there. tuner: a per-batch-size bandit picks the strategy (rollout.tuner).
    tree_strategies: strategies with topk > 1. sources: the draft sources a strategy may name
    ("drafter", "ngram"). max_depth: the deepest chain a call may ask for (None: any).
    sampled_sd: SD is lossless at temperature > 0 (False: such calls decode without SD, with a
    warning). prompt_history: n-gram drafts from earlier answers to the same prompt
    (rollout.group_drafts). live_drafter_reload: new drafter weights reach the engine in place.
    fixed_strategy: `fixed_strategy()` (the held-out accept length) can run here. capture: `generate`
    takes `capture=` (target hidden-state ids) and returns the features its forwards computed (the
    drafter corpus keeps them, so warm-start needs no second forward). checkpoint: what
    `state_dict()` holds, in words ("" when nothing).
    """

    name: str
    spec: bool = True
    per_call_spec: bool = True
    tail_switch: bool = True
    tuner: bool = False
    tree_strategies: bool = True
    sources: frozenset[str] = frozenset({"drafter", "ngram"})
    max_depth: int | None = None
    sampled_sd: bool = True
    prompt_history: bool = False
    live_drafter_reload: bool = True
    fixed_strategy: bool = True
    capture: bool = False
    checkpoint: str = ""


TailHook = Callable[[int], None]  # called with the number of running sequences when the rollout's tail starts


@runtime_checkable
class Engine(Protocol):
    """What an RL step, an evaluation and a checkpoint need of a rollout engine:
    tlt.rollout.torch_engine.engine.RolloutEngine (this process), tlt.rollout.workers.WorkerPool (CPU worker
    processes), tlt.rollout.vllm_engine.backend.VllmRolloutEngine (a vLLM worker process) or
    tlt.cluster.rollout_actor.RayRolloutPool (Ray actors).

    Per-call options go with the call (`generate`'s arguments, `fixed_strategy`'s block); what the
    engine supports is in `capabilities`, and a call it cannot honour raises
    `EngineCapabilityError` with the reason instead of decoding some
    other way. Callers never read or set an engine's config, bandit or prompt history."""

    def generate(self, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 spec: bool | None = None, spec_threshold: int | None = None,
                 on_tail: TailHook | None = None) -> RolloutBatch:
        """`group_size` responses per prompt, group-major. spec / spec_threshold: this call's SD on/off
        and tail threshold (None: the config's); on_tail: called once when the rollout's tail starts."""

    def sync(self, model=None) -> dict[str, float]:
        """Make the engine decode with `model`'s current weights (a no-op in this process)."""

    def sleep(self) -> dict[str, float]:
        """Before the policy update: hand the engine's accelerator memory to it (vLLM sleep mode;
        the `sync` after the update wakes the engine). {} where there is nothing to hand over."""

    @property
    def capabilities(self) -> Capabilities:
        """What this engine supports (`Capabilities` above): per-call SD, the tail
        switch, a bandit, tree strategies, draft sources and depth, lossless sampled SD, ..."""

    def state_dict(self) -> dict:
        """What a run checkpoint keeps of the engine ({"tuner": the bandit's state} where the engine
        holds one in this process; {} where there is nothing, e.g. pools whose workers keep their own)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output (keys the engine does not hold are ignored)."""

    def set_accept_prior(self, rate: float) -> dict | None:
        """The drafter's measured per-token acceptance (tlt.rollout.breakeven.rate_of of the held-out
        sampled accept length): the bandit's prior and the `auto` tail threshold are re-priced from
        the engine's cost curve at it (tlt.rollout.breakeven.reprice). Returns the calibration after it
        (a pool: its first worker's), None where the engine has no curve (then nothing changes)."""

    def close(self) -> None:
        """Stop what the engine started (worker processes, actors, the vLLM worker); idempotent, a
        no-op for the in-process torch engine."""

    def fixed_strategy(self, strategy: SpecStrategy, batch_size: int = 8) -> AbstractContextManager[None]:
        """A block in which every `generate` of up to `batch_size` prompts speculates with `strategy` on
        every step (bandit, spec guard, patience and pruning off, no earlier answers); the engine is as
        before afterwards. Used by tlt.rollout.acceptance.measure_accept (the held-out accept length).
        EngineCapabilityError where the engine cannot (a pool; a strategy it cannot run)."""


def torch_capabilities(cfg: RolloutConfig, tuner: bool, name: str = "the torch engine") -> Capabilities:
    """The torch engine's (tlt.rollout.torch_engine.engine): every strategy, drafter or n-gram (the n-gram drafter
    stands in when there is no drafter), lossless sampled SD, the tuner when it was given one."""
    return Capabilities(name=name, tuner=tuner, prompt_history=cfg.group_drafts, capture=True,
                        checkpoint="the bandit's state" if tuner else "")


def vllm_capabilities(method: str | None, k: int, sampled_sd: bool, tuner: bool) -> Capabilities:
    """A vLLM engine's (tlt.rollout.vllm_engine.backend) built with speculation `method` ("eagle3", "ngram" or
    None: none) and draft length `k`: chains of depth <= k from that one source, no trees, no drafts
    from earlier answers; sampled SD where the worker's rejection-sampler probe passed (`sampled_sd`)."""
    sources = {"eagle3": frozenset({"drafter"}), "ngram": frozenset({"ngram"})}.get(method, frozenset())
    return Capabilities(name="vLLM", spec=method is not None, tuner=tuner, tree_strategies=False, sources=sources,
                        max_depth=k, sampled_sd=sampled_sd, checkpoint="the bandit's state" if tuner else "")


def check_spec(caps: Capabilities, strategy: SpecStrategy) -> None:
    """Raise `EngineCapabilityError` with the reasons when a speculative call with `strategy`
    cannot run on the engine `caps` describes."""
    if not caps.spec:
        raise EngineCapabilityError(
            f"spec=True on {caps.name} built without speculation (rollout.spec false or no drafter): a drafter "
            "cannot be added to a live engine; build it with spec on")
    if strategy.plain:
        return
    why = []
    if strategy.topk > 1 and not caps.tree_strategies:
        why.append(f"it cannot run trees (topk {strategy.topk})")
    if caps.max_depth is not None and strategy.depth > caps.max_depth:
        why.append(f"depth {strategy.depth} is above the {caps.max_depth} it was built with")
    if strategy.source not in caps.sources:
        why.append(f"it drafts from {' or '.join(sorted(caps.sources))}, not {strategy.source}")
    if why:
        raise EngineCapabilityError(f"{caps.name} cannot run strategy {strategy.name} on this engine: "
                                    f"{'; '.join(why)}. The torch engine (rollout.backend: torch) runs every strategy")


def check_fixed_strategy(caps: Capabilities, strategy: SpecStrategy) -> None:
    """`fixed_strategy(strategy)` must be supported and `strategy` a drafting one the engine can run."""
    if not caps.fixed_strategy:
        raise EngineCapabilityError(
            f"{caps.name} cannot measure a fixed strategy: each of its workers keeps its own config and bandit; "
            "measure the held-out accept length on the run's generation engine (tlt.build.build_engine)")
    if strategy.plain:
        raise EngineCapabilityError("a fixed-strategy measurement needs a drafting strategy (depth >= 1), not the "
                                    "plain arm")
    check_spec(caps, strategy)


def fixed_config(cfg: RolloutConfig, strategy: SpecStrategy, batch_size: int) -> RolloutConfig:
    """`cfg` for a fixed-strategy measurement: every step of a batch of up to `batch_size` rows is a
    round of `strategy` (threshold >= batch, no patience), no spec guard, no confidence pruning."""
    return cfg.model_copy(update={"spec_threshold": max(1, batch_size), "spec_patience": 0, "guard_patience": 0,
                                  "strategy": strategy, "draft_min_prob": 0.0, "draft_stop_below": 0.0})


@contextmanager
def swapped(obj, **attrs):
    """Set `obj`'s attributes for the block, restore them after (an engine on itself only)."""
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield obj
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


class TunerState:
    """`state_dict` / `load_state_dict` of an engine whose checkpointed state is its bandit (`self.tuner`,
    None without one): the torch engine and vLLM; its cost curve (`calibration`, tlt.rollout.breakeven),
    the prior re-priced from it and the tail threshold it decodes with."""

    calibration: dict | None = None  # set by tlt.rollout.breakeven.calibrated
    auto_cap: int | None = None  # the most `spec_threshold: auto` may give on this engine (tlt.rollout.breakeven)

    def set_accept_prior(self, rate: float) -> dict | None:
        """Re-price the bandit's prior and the `auto` tail threshold at per-token acceptance `rate`."""
        if self.tuner is not None and self.calibration:
            self.calibration = reprice(self.tuner, self.calibration, rate)
        return self.calibration

    def threshold(self, override: int | None = None) -> int:
        """This call's tail threshold: `override`, else `rollout.spec_threshold` (its calibrated value for `auto`)."""
        return tail_threshold(self.cfg.spec_threshold, self.calibration, self.auto_cap) if override is None else override

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this engine: {"tuner": the bandit's state} ({} without a tuner)."""
        return {"tuner": self.tuner.state()} if self.tuner is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output; a saved bandit is ignored by an engine built without one."""
        if self.tuner is not None and "tuner" in state:
            self.tuner.load_state(state["tuner"])


class PerWorkerState:
    """The pools' side of the contract (worker pool, Ray pools): each worker keeps its own config and
    bandit, which run checkpoints do not hold, and a fixed-strategy measurement is refused; the
    accept prior goes to every worker (`_broadcast_prior`), each re-pricing from its own curve."""

    def set_accept_prior(self, rate: float) -> dict | None:
        self.calibrations = self._broadcast_prior(rate)
        return next((c for c in self.calibrations if c), None)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (`state_dict` is empty); a saved bandit is ignored."""

    @contextmanager
    def fixed_strategy(self, strategy: SpecStrategy, batch_size: int = 8):
        """Not here: raises EngineCapabilityError."""
        check_fixed_strategy(self.capabilities, strategy)
        yield
