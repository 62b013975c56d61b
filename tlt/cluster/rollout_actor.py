"""Rollout engines as Ray actors: `RayRolloutPool` shards GRPO groups over `cluster.rollout_actors`
actors, each a long-lived `RolloutEngine` (its KV cache, weights and tuner stay across steps).

Weights travel through the object store: when the policy's or the drafter's version moved
(tlt.versions; checked after every RL step's update by `sync`, and before every rollout),
their state is `ray.put` once for the new push and every actor loads that one object (only the
modules whose version it has not loaded yet). Each
shard's result carries the version its actor decoded with; a mismatch is an error, so a rollout
never mixes policies. A dead actor (killed, OOM, node lost) is restarted by Ray (`max_restarts`);
the pool reloads the current version into it and re-runs that shard, so the step completes with
nothing lost. Same `Engine` contract as `tlt.rollout.workers.WorkerPool`, whose shard/merge it
reuses (shard i samples with seed `seed + i`), so outputs equal the local pool's.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Callable

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from tlt.cluster.placement import RayPlacement
from tlt.config import RolloutConfig
from tlt.device import to_cpu
from tlt.drafter.model import Eagle3Drafter
from tlt.faults import fault
from tlt.rollout.contract import Capabilities, PerWorkerState
from tlt.rollout.torch_engine.build import build_engine
from tlt.rollout.batch import RolloutBatch
from tlt.versions import Synced, version_of, write_weights
from tlt.rollout.workers import merge_batches, shard_sizes

_RESTART_TIMEOUT_S = 300.0  # how long a dead actor may take to come back
_TAIL_POLL_S = 0.05  # how often the driver looks for an actor's tail start while shards run
_ACTOR_ENV = ("TLT_FAULT", "TLT_VLLM_PYTHON", "TLT_VLLM_THREADS")  # the driver's, passed on to the actors


class RolloutActor:
    """One engine in its own Ray worker process; weights arrive with `load(version, weights)`."""

    def __init__(self, rank: int, model_cls, model_config, dtype: torch.dtype, rollout_json: str, eos_ids: list[int],
                 pad_id: int, threads: int, seed: int, drafter_args: tuple | None):
        torch.set_num_threads(threads)
        cfg = RolloutConfig.model_validate_json(rollout_json)
        device = "cuda" if ray.get_gpu_ids() else "cpu"  # Ray shows a GPU actor its device(s) only
        self._models(rank, model_cls, model_config, dtype, drafter_args, device)
        self.engine = build_engine(self.model, cfg, eos_ids, pad_id, self.drafter, seed=seed, rank=rank,
                                   calibrate_vocab=model_config.vocab_size)  # its own cores: its own cost curve

    def _models(self, rank: int, model_cls, model_config, dtype: torch.dtype, drafter_args: tuple | None,
                device: str) -> None:
        """A randomly initialised policy (+ drafter) of the run's architecture; `load` fills them."""
        self.rank, self.version = rank, -1  # -1: random init, no policy loaded yet
        self.loaded: dict[str, int] = {}  # the driver's module versions this actor holds
        self.model = model_cls(model_config).to(device=device, dtype=dtype).eval()
        self.drafter = None
        if drafter_args is not None:
            vd, aux_ids = drafter_args
            self.drafter = Eagle3Drafter(model_config, self.model.get_input_embeddings().weight, vd, aux_ids)
            self.drafter = self.drafter.to(device).eval()

    def load(self, version: int, weights: dict) -> int:
        """Push `version`: the modules whose driver version this actor does not hold yet are loaded
        (and their local version bumped, so the engine refreshes its copies and re-arms its guard)."""
        for name, module in (("policy", self.model), ("drafter", self.drafter)):
            if module is not None and self.loaded.get(name) != weights["versions"][name]:
                write_weights(module, weights[name])
        self.loaded = dict(weights["versions"])
        self.version = version
        return version

    def generate(self, prompts: list[list[int]], kwargs: dict, tails=None, call: int = 0) -> tuple[RolloutBatch, int]:
        """One shard; `tails` (a Ray queue): this engine's tail start goes there as (call, running rows)."""
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            fault("rollout_actor", self.rank)  # crash tests: kill this actor at its first shard, once
        if tails is not None:
            kwargs = {**kwargs, "on_tail": lambda running: tails.put_nowait((call, running))}
        return self.engine.generate(prompts, **kwargs), self.version

    def pid(self) -> int:
        return os.getpid()

    def set_accept_prior(self, rate: float) -> dict | None:
        """Re-price this engine's bandit from its own cost curve; its calibration after it."""
        self.engine.set_accept_prior(rate)
        return self.engine.calibration

    def capabilities(self) -> Capabilities:
        """This actor's engine's (the pool reports them, less what stays in the actors)."""
        return self.engine.capabilities


class RayRolloutPool(PerWorkerState):
    """`cluster.rollout_actors` rollout actors in the run's placement group (bundles 0..n-1)."""

    def __init__(self, placement: RayPlacement, model, cfg: RolloutConfig, eos_ids: list[int], pad_id: int,
                 drafter=None, seed: int = 0):
        self.cfg, self.placement = cfg, placement
        self.n = placement.cfg.rollout_actors
        self._caps: Capabilities | None = None  # the actors' engines', asked once
        self._model, self._drafter = model, drafter if cfg.drafter == "eagle" else None
        self.version, self.rollout_version, self.rollout_drafter_version, self.restarts = -1, -1, 0, 0
        self._synced, self._ref = None, None
        self._tails, self._calls = None, 0  # the queue actors' tail starts reach the driver by (created on demand)
        self._prior: float | None = None  # the accept prior sent (a restarted actor gets it again)
        self.calibrations: list[dict | None] = [None] * self.n
        c = placement.cfg
        env = {k: os.environ[k] for k in _ACTOR_ENV if k in os.environ}
        self._dargs = None if self._drafter is None else (self._drafter.draft_vocab_size, self._drafter.aux_layer_ids)
        self._eos, self._pad, self._seed = list(eos_ids), pad_id, seed
        self.actors = [ray.remote(self.actor_cls).options(
            num_cpus=c.rollout_actor_cpus, num_gpus=c.rollout_actor_gpus, max_restarts=c.max_restarts,
            max_task_retries=0, scheduling_strategy=placement.strategy(rank), name=None,
            runtime_env={"env_vars": env} if env else None).remote(*self._actor_args(rank))
            for rank in range(self.n)]
        self._push()

    actor_cls = RolloutActor

    def _actor_args(self, rank: int) -> tuple:
        """`actor_cls`'s constructor arguments for actor `rank` (Ray repeats them at a restart)."""
        m, cfg = self._model, self.cfg
        return (rank, type(m), m.config, next(m.parameters()).dtype, cfg.model_dump_json(), self._eos, self._pad,
                max(1, int(self.placement.cfg.rollout_actor_cpus)), self._seed, self._dargs)

    def _modules(self) -> dict:
        return {"policy": self._model, "drafter": self._drafter}

    def _push(self) -> bool:
        """Put the weights in the object store once per push and load them on every actor, when
        the policy's or the drafter's version moved since the last push (or none was made)."""
        if self._synced is not None and not self._synced.moved(**self._modules()):
            return False
        self.version += 1
        weights = {"policy": self._model.state_dict(), "versions": {n: version_of(m) for n, m in self._modules().items()}}
        if self._drafter is not None:
            weights["drafter"] = self._drafter.state_dict()
        self._ref = ray.put(to_cpu(weights))  # actors load CPU tensors onto their own device
        self._synced = Synced(**self._modules())
        for ref in [a.load.remote(self.version, self._ref) for a in self.actors]:
            try:
                ray.get(ref)
            except RayActorError:
                pass  # died meanwhile: restarted with no policy (version -1), reloaded by `generate`
        return True

    def sync(self, model=None) -> dict[str, float]:
        """After an RL step's update: push a new version when the policy's or drafter's version moved.
        `model` is ignored: the pool pushes the model it was built on. Returns the push this step's
        rollout decoded with and the one pushed, and the drafter version the rollout drafted with."""
        pushed = self._push()
        out = {"rollout/policy_version": float(self.rollout_version), "cluster/weights_version": float(self.version),
               "cluster/weights_pushed": float(pushed), "cluster/actor_restarts": float(self.restarts)}
        if self._drafter is not None:
            out["cluster/drafter_version"] = float(self.rollout_drafter_version)
        return out

    def sleep(self) -> dict[str, float]:
        """Nothing to hand to the update: torch actors keep their weights (vLLM actors: vllm_actor.py)."""
        return {}

    @property
    def capabilities(self) -> Capabilities:
        """The actors' engines' (asked of actor 0 once), less `fixed_strategy` and checkpointed state,
        which stay in the actors; `on_tail` fires at the first actor's tail or the first shard back."""
        if self._caps is None:
            caps = ray.get(self.actors[0].capabilities.remote())
            self._caps = replace(caps, name=f"the Ray rollout pool (actors: {caps.name})", fixed_strategy=False,
                                 checkpoint="")
        return self._caps

    def _broadcast_prior(self, rate: float) -> list[dict | None]:
        """Every actor re-prices its bandit at `rate` (and again after a restart); their calibrations."""
        self._prior = rate
        return ray.get([a.set_accept_prior.remote(rate) for a in self.actors])

    def _submit(self, rank: int, shard: tuple):
        return self.actors[rank].generate.remote(*shard)

    def _tail_queue(self):
        """The queue every actor's engine reports its tail start to (one per pool, no CPU of its own)."""
        if self._tails is None:
            from ray.util.queue import Queue  # deferred: only a rollout with an `on_tail` hook needs it

            self._tails = Queue(actor_options={"num_cpus": 0})
        return self._tails

    def _actor_tail(self, call: int) -> int | None:
        """Running rows of the first actor whose engine reported this call's tail start, or None."""
        from ray.util.queue import Empty  # deferred with the queue

        while True:
            try:
                got, running = self._tails.get_nowait()
            except Empty:
                return None
            if got == call:  # events of an earlier call (a shard re-run after a restart) are dropped
                return int(running)

    def _retry(self, rank: int, err: Exception | None) -> None:
        """The actor died: Ray restarts it (random weights); load the current version (the shard is
        then re-run). Ray gives up after `cluster.max_restarts`: the error names the actor."""
        self.restarts += 1
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while True:
            try:
                ray.get(self.actors[rank].load.remote(self.version, self._ref))
                if self._prior is not None:
                    ray.get(self.actors[rank].set_accept_prior.remote(self._prior))
                return
            except ActorUnavailableError:  # still restarting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
            except ActorDiedError as again:
                raise RuntimeError(f"rollout actor {rank} is dead after {self.restarts} restart(s) "
                                   f"(cluster.max_restarts={self.placement.cfg.max_restarts})") from (err or again)

    def generate(self, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 spec: bool | None = None, spec_threshold: int | None = None,
                 on_tail: Callable[[int], None] | None = None) -> RolloutBatch:
        """Same contract as `WorkerPool.generate`. `on_tail` fires once, at the first of: an actor's
        engine enters its tail (fewer running rows than its threshold; called with those rows, as the
        torch engine calls it), the first shard is back (called with the actors still decoding)."""
        self._push()  # weights changed outside an RL step's sync (a resumed checkpoint, a reload)
        self._calls += 1
        relay = (self._tail_queue(), self._calls) if on_tail is not None else ()
        shards, start = [], 0
        for i, size in enumerate(shard_sizes(len(prompts), self.n)):
            shards.append((prompts[start:start + size], dict(
                group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                seed=seed + i, spec=spec, spec_threshold=spec_threshold), *relay))
            start += size
        t0 = time.perf_counter()
        parts, finished_at = self._collect(shards, on_tail)
        wall = time.perf_counter() - t0
        self.rollout_version, self.rollout_drafter_version = self.version, self._synced.version("drafter")
        idle = sum(t0 + wall - t for t in finished_at.values())
        return merge_batches([parts[i] for i in range(len(shards))], group_size, wall, idle)

    def _collect(self, shards: list[tuple], on_tail) -> tuple[dict[int, RolloutBatch], dict[int, float]]:
        """Run every shard to its end (a dead actor's shard re-run); relay the tail start to `on_tail`."""
        pending = {self._submit(i, s): i for i, s in enumerate(shards)}
        parts: dict[int, RolloutBatch] = {}
        finished_at: dict[int, float] = {}
        waiting = on_tail is not None  # for the tail: poll the actors' reports while the shards run
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_TAIL_POLL_S if waiting else None)
            running = self._actor_tail(self._calls) if waiting else None
            if running is not None:
                waiting = False
                on_tail(running)
            if not ready:
                continue
            rank = pending.pop(ready[0])
            try:
                batch, version = ray.get(ready[0])
            except RayActorError as err:  # died during the shard
                self._retry(rank, err)
                pending[self._submit(rank, shards[rank])] = rank
                continue
            if version == -1:  # died and was restarted since its last load: no policy in it
                self._retry(rank, None)
                pending[self._submit(rank, shards[rank])] = rank
                continue
            if version != self.version:
                raise RuntimeError(f"rollout actor {rank} decoded with policy version {version}, not {self.version}")
            parts[rank], finished_at[rank] = batch, time.perf_counter()
            if waiting and pending:
                waiting = False
                on_tail(len(pending))  # an actor is idle while the others finish their tails
        return parts, finished_at

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self._tails is not None:
            self._tails.shutdown()
            self._tails = None
