"""One Ray placement group per run: a bundle per rollout actor, then one per trainer rank.

`RayPlacement.start(cluster_cfg, world_size)` connects to Ray (`cluster.address`: '' starts a
local instance for this run and shuts it down at `close()`; 'auto' / 'ray://host:port' joins an
existing cluster and leaves it running), reserves the bundles and waits until they are placed.
Actors are pinned to a bundle with `strategy(i)`. `params()` is what the run logs to MLflow.
"""
from __future__ import annotations

import os
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tlt.config import ClusterConfig


def bundles(cfg: ClusterConfig, world_size: int) -> list[dict[str, float]]:
    """Rollout-actor bundles first (index 0..rollout_actors-1), then trainer ranks when world_size > 1
    (`cluster.placement: split`); colocated, bundle i holds rollout actor i and trainer rank i (the
    config check makes their counts equal), so both see the same GPU."""
    def one(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

    ranks = world_size > 1
    if cfg.placement == "colocated":
        return [one(cfg.rollout_actor_cpus + ranks * cfg.trainer_cpus, cfg.rollout_actor_gpus + ranks * cfg.trainer_gpus)
                for _ in range(cfg.rollout_actors)]
    out = [one(cfg.rollout_actor_cpus, cfg.rollout_actor_gpus) for _ in range(cfg.rollout_actors)]
    if ranks:
        out += [one(cfg.trainer_cpus, cfg.trainer_gpus) for _ in range(world_size)]
    return out


def connect(address: str, need_cpus: float) -> bool:
    """`ray.init` for the run; True when this call started a local instance (ours to shut down).

    A local instance declares at least the CPUs the bundles need (Ray's CPUs are logical: on a
    small machine the actors share the cores), no dashboard, and no token auth (Ray 2.60 turns it
    on by default; an existing cluster keeps whatever its operator set)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cpus = max(int(-(-need_cpus // 1)), os.cpu_count() or 1)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


class RayPlacement:
    """The run's placement group and the Ray connection it lives on."""

    def __init__(self, cfg: ClusterConfig, world_size: int, pg, owns_ray: bool, start_s: float):
        self.cfg, self.world_size, self.pg, self.owns_ray, self.start_s = cfg, world_size, pg, owns_ray, start_s

    @classmethod
    def start(cls, cfg: ClusterConfig, world_size: int, timeout_s: float = 300.0) -> "RayPlacement":
        t0 = time.perf_counter()
        spec = bundles(cfg, world_size)
        owns = connect(cfg.address, sum(b["CPU"] for b in spec))
        pg = placement_group(spec, strategy=cfg.placement_strategy, name=f"tlt-{os.getpid()}-{time.time_ns()}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            if owns:
                ray.shutdown()
            raise RuntimeError(f"Ray could not place the run's bundles {spec} within {timeout_s:.0f} s; the cluster "
                               f"has {ray.cluster_resources()}: lower cluster.*_cpus / *_gpus or add nodes")
        return cls(cfg, world_size, pg, owns, time.perf_counter() - t0)

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle,
                                                placement_group_capture_child_tasks=True)

    def trainer_bundle(self, rank: int) -> int:
        return rank if self.cfg.placement == "colocated" else self.cfg.rollout_actors + rank

    def params(self) -> dict[str, str]:
        """Placement as MLflow params (the run's config already holds cluster.*); only values a
        resumed run repeats (MLflow params are immutable): node counts and timings are metrics."""
        return {"placement.rollout_actors": str(self.cfg.rollout_actors), "placement.world_size": str(self.world_size),
                "placement.bundles": str(bundles(self.cfg, self.world_size)),
                "placement.strategy": self.cfg.placement_strategy,
                "placement.ray_address": self.cfg.address or "local", "placement.ray_version": ray.__version__}

    def nodes(self) -> int:
        """Ray nodes the run's bundles landed on."""
        table = ray.util.placement_group_table(self.pg)
        return len(set(table.get("bundles_to_node_id", {}).values())) or 1

    def close(self) -> None:
        if not ray.is_initialized():
            return
        remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()
