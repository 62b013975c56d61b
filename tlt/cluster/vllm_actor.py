"""vLLM rollout engines as Ray actors (`cluster.backend: ray` with `rollout.backend: vllm`).

Each `VllmRolloutActor` owns a `VllmRolloutEngine`, i.e. a vLLM worker process on the actor's
node, started with the vLLM venv's interpreter at the same path on every node (`.venv-vllm`
beside the tlt checkout, or $TLT_VLLM_PYTHON, which the pool passes on to its actors). Not Ray's
`runtime_env` interpreter: the actor itself needs tlt's environment (its copy of the policy, the
safetensors export, the drafter's EAGLE-3 export), which the vLLM venv lacks, and a worker process
of its own keeps vLLM's logging and threads out of Ray's worker. On a GPU node Ray sets the actor's
CUDA_VISIBLE_DEVICES, which the worker process inherits: the engine runs on the actor's GPU(s).

Everything else is the torch actors' (rollout_actor.py): weights arrive by version from the
object store (`load`: into the actor's copy of the policy, then the in-place reload of the
worker), every shard reports the version it decoded with, a dead actor is restarted by Ray, the
pool reloads the current version into it and re-runs its shard. With sleep mode
(`rollout.vllm.sleep_mode`, colocated on GPUs) `sleep` puts every engine to sleep before the
policy update; the next weight push wakes them.
"""
from __future__ import annotations

import os
from pathlib import Path

import ray
import torch
from ray.exceptions import RayActorError

from tlt.cluster.rollout_actor import RayRolloutPool, RolloutActor
from tlt.config import RolloutConfig
from tlt.rollout.torch_engine.build import worker_seed
from tlt.rollout.vllm_engine.backend import VllmRolloutEngine


class VllmRolloutActor(RolloutActor):
    """One vLLM engine on the actor's node; `load(version, weights)` syncs it in place."""

    def __init__(self, rank: int, model_cls, model_config, dtype: torch.dtype, rollout_json: str, eos_ids: list[int],
                 pad_id: int, threads: int, tokenizer, drafter_args: tuple | None, engine_kw: dict):
        torch.set_num_threads(threads)
        os.environ.setdefault("TLT_VLLM_THREADS", str(threads))  # the worker's share of the node's cores
        self._models(rank, model_cls, model_config, dtype, drafter_args, "cpu")  # vLLM holds the GPU copy
        self.engine = VllmRolloutEngine(self.model, RolloutConfig.model_validate_json(rollout_json), eos_ids, pad_id,
                                        drafter=self.drafter, tokenizer=tokenizer, **engine_kw)

    def load(self, version: int, weights: dict) -> int:
        super().load(version, weights)
        self.synced = self.engine.sync()  # wakes a sleeping engine, then reloads the changed weights in place
        return version

    def last_sync(self) -> dict[str, float]:
        """The `rollout/vllm_*` metrics of the last `load` (sync and reload times, wake, rebuilds)."""
        return getattr(self, "synced", {})

    def sleep(self) -> dict[str, float]:
        return self.engine.sleep()

    def worker_pid(self) -> int:
        return self.engine.proc.pid

    def options(self) -> list[str]:
        """`rollout.vllm` as the worker resolved it on this actor's platform."""
        return self.engine.options


def _each(refs: list) -> list[dict]:
    """The replies of the actors that answered; one that died meanwhile is restarted awake, without
    weights, and reloaded before its next shard (`RayRolloutPool.generate`)."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except RayActorError:
            continue
    return out


class RayVllmPool(RayRolloutPool):
    """`cluster.rollout_actors` vLLM actors; the same sharding, versions and restarts as the torch pool."""

    actor_cls = VllmRolloutActor

    def __init__(self, placement, model, cfg: RolloutConfig, eos_ids: list[int], pad_id: int, tokenizer,
                 run_dir: str | Path, drafter=None, seed: int = 0, max_model_len: int | None = None):
        self._tokenizer, self._run_dir = tokenizer, Path(run_dir)
        self._max_model_len = max_model_len or 1024
        super().__init__(placement, model, cfg, eos_ids, pad_id, drafter=drafter, seed=seed)

    def _actor_args(self, rank: int) -> tuple:
        m, cfg = self._model, self.cfg
        kw = {"run_dir": str(self._run_dir / f"rollout-actor-{rank}"), "max_model_len": self._max_model_len,
              "max_num_seqs": cfg.prompts_per_step * cfg.group_size, "seed": worker_seed(self._seed, rank),
              "colocated": self.placement.cfg.placement == "colocated"}
        return (rank, type(m), m.config, next(m.parameters()).dtype, cfg.model_dump_json(), self._eos, self._pad,
                max(1, int(self.placement.cfg.rollout_actor_cpus)), self._tokenizer, self._dargs, kw)

    def sync(self, model=None) -> dict[str, float]:
        """The torch pool's `sync`, plus the actors' `rollout/vllm_*` metrics (the slowest actor's)."""
        out = super().sync(model)
        for m in _each([a.last_sync.remote() for a in self.actors]):
            for k, v in m.items():
                out[k] = max(out.get(k, v), v)
        return out

    def sleep(self) -> dict[str, float]:
        """Every engine to sleep (sleep mode only) before the policy update; `sync` wakes them."""
        times = [m.get("rollout/vllm_sleep_s", 0.0) for m in _each([a.sleep.remote() for a in self.actors])]
        return {"rollout/vllm_sleep_s": max(times)} if any(times) else {}

    def options(self) -> list[list[str]]:
        return ray.get([a.options.remote() for a in self.actors])

    def worker_pids(self) -> list[int]:
        return ray.get([a.worker_pid.remote() for a in self.actors])
