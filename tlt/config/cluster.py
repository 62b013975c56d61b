"""Where a run's work runs: the Ray cluster and its placement (`cluster.*`), and the vLLM engine's
hardware options (`rollout.vllm.*`), with the cross-checks between them. Part of `RunConfig`
(stages.py); defaults live here and only here."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from tlt.config.base import Stage


TrainDevice = Literal["auto", "cpu", "cuda"]
DEVICE_FIELD = Field("auto", description="Where the policy (and the drafter beside it) lives and is updated: auto = "
                     "the GPU where torch sees one, else the CPU; cuda is refused before the run starts on a machine "
                     "without one. On Ray every trainer rank (trainer.world_size > 1) uses the GPU Ray gave it "
                     "(cluster.trainer_gpus)")


class VllmConfig(Stage):
    enforce_eager: bool | Literal["auto"] = Field(
        "auto", description="Decode without CUDA graphs or torch.compile (auto: eager on CPU, where compiling "
        "costs minutes at start, CUDA graphs on a GPU)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=0.98, description="Share of each of its GPUs the vLLM "
                                          "engine takes (weights, activations, CUDA graphs; the KV cache gets the "
                                          "rest); leave the update its room unless sleep mode hands it over. GPU "
                                          "only: on CPU tlt sizes the KV cache for the batch")
    sleep_mode: bool | Literal["auto"] = Field(
        "auto", description="vLLM sleeps (level 1: weights to host memory, KV cache dropped) during the policy "
        "update and wakes before the weight sync (auto: where a GPU is shared with the update: a local run, or "
        "cluster.placement colocated; vLLM's CPU build has none, true there is refused)")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs of one vLLM engine (tensor parallelism "
                                      "for a large target); on Ray each rollout actor reserves that many")


class ClusterConfig(Stage):
    backend: Literal["local", "ray"] = Field("local", description="local: everything in this process tree; ray: "
                                             "rollout engines and trainer ranks as Ray actors in one placement group")
    address: str = Field("", description="Ray cluster: '' = a local Ray instance started for the run; 'auto' or "
                         "'ray://host:port' = an existing cluster")
    rollout_actors: int = Field(1, ge=1, le=1024, description="Rollout engine actors (GRPO groups sharded across them)")
    rollout_actor_cpus: float = Field(1.0, gt=0, description="CPUs reserved per rollout actor (its torch threads)")
    rollout_actor_gpus: float = Field(0.0, ge=0, description="GPUs reserved per rollout actor")
    trainer_cpus: float = Field(1.0, gt=0, description="CPUs reserved per trainer rank (trainer.world_size > 1)")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs reserved per trainer rank (trainer.world_size > 1)")
    max_restarts: int = Field(3, ge=0, description="Restarts of a dead rollout actor; its shard is re-run on the "
                              "restarted actor with the current policy version")
    placement: Literal["split", "colocated"] = Field(
        "split", description="split: rollout actors and trainer ranks on bundles of their own; colocated: trainer "
        "rank i shares rollout actor i's bundle (its GPU: vLLM sleeps during the update, rollout.vllm.sleep_mode)")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy of the run's bundles")

    @field_validator("address")
    @classmethod
    def _ray_address(cls, address: str) -> str:
        if address in ("", "auto") or re.fullmatch(r"(ray://)?[\w.-]+:\d{1,5}", address):
            return address
        raise ValueError(f"'{address}' is not a Ray address; use '' (a local Ray started for the run), 'auto', "
                         "'ray://HOST:PORT' (Ray client) or 'HOST:PORT' (the GCS of a cluster)")


def placement_checks(c: ClusterConfig, trainer, rollout_backend: str, v: VllmConfig) -> None:
    """`cluster.backend: ray`: the placement's cross-checks (a ValueError naming the fix); `trainer`
    is the run's TrainerConfig."""
    vllm, ws = rollout_backend == "vllm", trainer.world_size
    if ws > 1 and trainer.device == "cuda" and not c.trainer_gpus:
        raise ValueError("trainer.device: cuda puts each trainer rank on a GPU, but cluster.trainer_gpus is 0 (Ray "
                         "gives the ranks none): set cluster.trainer_gpus (e.g. 1, or 0.5 colocated), or "
                         "trainer.device: auto")
    if ws > 1 and trainer.device == "cpu" and c.trainer_gpus:
        raise ValueError(f"trainer.device: cpu keeps the trainer ranks on their CPUs, but cluster.trainer_gpus = "
                         f"{c.trainer_gpus:g} reserves GPUs for them that they would not use: set "
                         "cluster.trainer_gpus: 0, or trainer.device: auto")
    if c.placement == "colocated" and ws > 1 and c.rollout_actors != ws:
        raise ValueError(f"cluster.placement: colocated puts trainer rank i on rollout actor i's bundle, but there "
                         f"are {c.rollout_actors} actors for {ws} ranks: set cluster.rollout_actors: {ws}, or "
                         "cluster.placement: split")
    if vllm and v.tensor_parallel_size > 1 and c.placement == "colocated":
        raise ValueError("rollout.vllm.tensor_parallel_size > 1 gives each rollout actor whole GPUs, which Ray "
                         "cannot share with a trainer rank: set cluster.placement: split, or tensor_parallel_size: 1")
    if vllm and c.rollout_actor_gpus and c.rollout_actor_gpus != v.tensor_parallel_size and (
            v.tensor_parallel_size > 1 or c.rollout_actor_gpus > 1):
        raise ValueError(f"each rollout actor's vLLM engine spans rollout.vllm.tensor_parallel_size = "
                         f"{v.tensor_parallel_size} GPU(s) but reserves cluster.rollout_actor_gpus = "
                         f"{c.rollout_actor_gpus:g}: set cluster.rollout_actor_gpus: {v.tensor_parallel_size}")
    if vllm and v.sleep_mode is True and c.placement == "split" and ws > 1:
        raise ValueError("rollout.vllm.sleep_mode: true frees the rollout GPUs for an update that shares them, but "
                         "cluster.placement: split gives the trainer ranks GPUs of their own: set sleep_mode: auto "
                         "or cluster.placement: colocated")
