"""Fixed speculation schedules: the baselines tlt's tail switch and bandit are measured against (bench/).

SD always on with one strategy is an engine's own `fixed_strategy(strategy, batch_size)`. A static
schedule gives each batch-size tier (the bandit's buckets) one fixed draft length and never explores
(`StrategyTuner.static`); these functions put one in the place of an engine's bandit, on the torch
engine and on vLLM alike (an engine built with a bandit: `rollout.tuner`; on vLLM, with speculation).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from tlt.rollout.contract import swapped
from tlt.rollout.tuner import StrategyTuner


def install_static(engine, buckets: list[int], depths: list[int]) -> None:
    """From now on `engine` drafts depths[i] in bucket i (0: plain decoding) instead of asking its bandit."""
    if engine.tuner is None:
        raise ValueError("a static schedule takes the bandit's place: build the engine with rollout.tuner on")
    engine.tuner = StrategyTuner.static(buckets, depths)


@contextmanager
def static_schedule(engine, buckets: list[int], depths: list[int], threshold: int) -> Iterator[None]:
    """Within the block: the static table in place of the bandit, SD at batch sizes <= `threshold` from
    the first step (no patience) and no spec guard; the engine's config and bandit restored after."""
    update = {"spec_threshold": threshold, "spec_patience": 0, "guard_patience": 0}
    with swapped(engine, cfg=engine.cfg.model_copy(update=update), tuner=StrategyTuner.static(buckets, depths)):
        yield
