"""The one builder of a torch engine, wherever it runs: the driver (`rank` None), a worker-pool
process or a Ray rollout actor (`rank` 0, 1, ...), with the one seed rule for its bandit (and for a
vLLM actor's sampler: `worker_seed`)."""
from __future__ import annotations

from tlt.config import RolloutConfig
from tlt.rollout.breakeven import calibrated
from tlt.rollout.torch_engine.engine import RolloutEngine
from tlt.rollout.tuner import StrategyTuner


def worker_seed(seed: int, rank: int | None) -> int:
    """The seed of the engine at `rank`: the run's `rl.seed` for the driver's engine (rank None),
    `seed * 1000 + rank` for worker or actor `rank`, so no two engines of a run draw the same
    bandit or sampler stream."""
    return seed if rank is None else seed * 1000 + rank


def build_engine(model, cfg: RolloutConfig, eos_ids: list[int], pad_id: int, drafter=None, seed: int = 0,
                 rank: int | None = None, calibrate_vocab: int | None = None) -> RolloutEngine:
    """A torch engine over `model` (+ `drafter`), with a bandit seeded by `worker_seed(seed, rank)`
    when `cfg.tuner`. `calibrate_vocab` (the target's vocabulary size): calibrate the bandit on the
    cost curve of the cores this engine runs on first (tlt.rollout.breakeven, when `tuner_calibrate`):
    the driver, every pool worker and every Ray actor measure their own."""
    tuner = StrategyTuner.from_config(cfg, seed=worker_seed(seed, rank)) if cfg.tuner else None
    engine = RolloutEngine(model, cfg, eos_ids, pad_id, drafter=drafter, tuner=tuner)
    return calibrated(engine, tuner, cfg, calibrate_vocab) if calibrate_vocab is not None else engine
