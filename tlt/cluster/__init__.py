"""Scale-out on Ray (`cluster.backend: ray`): the only package that imports `ray` (an optional
extra: `pip install '.[ray]'`).

`RayRun.start` places the run (placement.py), starts the rollout actors (torch engines:
rollout_actor.py; vLLM engines: vllm_actor.py) and, with `trainer.world_size` > 1, the DeepSpeed
trainer ranks (trainer_ranks.py). The pipeline uses
`engine` as its RL rollout engine and `updater` as its policy updater; the drafter (refresher or
spot trainer), evaluation, checkpoints and tracking stay in the driver process.
"""
from __future__ import annotations

import time
from pathlib import Path

from tlt.cluster.placement import RayPlacement
from tlt.cluster.rollout_actor import RayRolloutPool, RolloutActor
from tlt.cluster.trainer_ranks import RayDeepSpeedUpdater, TrainerRank
from tlt.cluster.vllm_actor import RayVllmPool, VllmRolloutActor
from tlt.config import RunConfig
from tlt.rl.update import make_updater


class RayRun:
    """A run's placement group, rollout pool and (world size > 1) trainer ranks; `close()` ends all."""

    def __init__(self, placement: RayPlacement, engine: RayRolloutPool, updater, start_s: float):
        self.placement, self.engine, self.updater, self.start_s = placement, engine, updater, start_s

    @classmethod
    def start(cls, cfg: RunConfig, model, drafter, eos_ids: list[int], pad_id: int, tokenizer=None,
              run_dir: str | Path = "runs/ray") -> "RayRun":
        """Ray up, bundles placed, rollout actors started with the current weights (version 0): torch
        engines, or (rollout.backend: vllm) vLLM engines, which also need the tokenizer and a run dir."""
        t0 = time.perf_counter()
        placement = RayPlacement.start(cfg.cluster, cfg.trainer.world_size)
        try:
            if cfg.rollout.backend == "vllm":
                engine = RayVllmPool(placement, model, cfg.rollout, eos_ids, pad_id, tokenizer, Path(run_dir) / "actors",
                                     drafter=drafter, seed=cfg.rl.seed,
                                     max_model_len=cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens + 8)
            else:
                engine = RayRolloutPool(placement, model, cfg.rollout, eos_ids, pad_id, drafter=drafter, seed=cfg.rl.seed)
        except BaseException:
            placement.close()
            raise
        updater = (RayDeepSpeedUpdater(placement, model, cfg.rl, cfg.trainer) if cfg.trainer.world_size > 1
                   else make_updater(model, cfg))  # world size 1: the update stays in the driver
        return cls(placement, engine, updater, time.perf_counter() - t0)

    def params(self) -> dict[str, str]:
        """Placement as MLflow params: actors, world size, bundles, strategy, Ray address and version."""
        return self.placement.params()

    def metrics(self) -> dict[str, float]:
        """The fixed start-up (Ray + bundles placed; + rollout actors up with version 0) and nodes used."""
        return {"cluster/ray_start_s": self.placement.start_s, "cluster/start_s": self.start_s,
                "cluster/nodes": float(self.placement.nodes())}

    def close(self) -> None:
        try:
            if isinstance(self.updater, RayDeepSpeedUpdater):
                self.updater.close()
        finally:
            try:
                self.engine.close()
            finally:
                self.placement.close()


__all__ = ["RayDeepSpeedUpdater", "RayPlacement", "RayRolloutPool", "RayRun", "RayVllmPool", "RolloutActor", "TrainerRank",
           "VllmRolloutActor"]
