"""The rollout floor: the engine contract (contract.py), the result type (batch.py), the one
accept-length definition (acceptance.py), what every engine shares (stats, spec guard, bandit,
calibration, schedules), and its wings: the torch engine (torch_engine/), the vLLM backend
(vllm_engine/), a process pool of torch engines (workers.py). Ray actors live in tlt/cluster/."""
from tlt.rollout.acceptance import accept_length
from tlt.rollout.batch import RolloutBatch
from tlt.rollout.torch_engine.engine import RolloutEngine
from tlt.rollout.torch_engine.ngram import NgramDrafter
from tlt.rollout.tuner import StrategyTuner, default_arms

__all__ = ["RolloutEngine", "RolloutBatch", "accept_length", "NgramDrafter", "StrategyTuner", "default_arms"]
