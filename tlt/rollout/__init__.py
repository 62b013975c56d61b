"""Rollout: batched decoding with a slot KV cache, tail-switched speculative decoding, strategy tuner."""
from tlt.rollout.engine import RolloutEngine, accept_length
from tlt.rollout.ngram import NgramDrafter
from tlt.rollout.state import RolloutBatch
from tlt.rollout.tuner import StrategyTuner, default_arms

__all__ = ["RolloutEngine", "RolloutBatch", "accept_length", "NgramDrafter", "StrategyTuner", "default_arms"]
