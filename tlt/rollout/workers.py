"""Rollout worker processes: GRPO groups sharded across `rollout.workers` processes on one machine.

Each worker runs its own `RolloutEngine` (own KV cache, own tuner, its share of the CPU threads)
over the *same* policy and drafter tensors as the trainer: the parameters live in shared memory
(`share_memory_()` in place, so the optimizer's in-place updates are seen by every worker with no
copy and no disk). When the policy's or the drafter's version moved (tlt.versions), `sync()`
copies the tensors whose storage a backend rebound (DeepSpeed's flat buffers) into the shared ones,
and every worker learns the new versions with its next shard (its engine then refreshes a
rollout-dtype copy and re-arms its spec guard).

`generate` has the engine's signature and returns one merged `RolloutBatch` in the same
group-major order as a single engine would. When the first worker finishes its shard while the
others are still decoding their long tails, `on_tail` fires: the spot trainer (tlt.drafter.spot)
starts training the drafter on the cores that worker left idle (TLT mechanism 2).
CPU only: on GPUs use one vLLM engine per device (`rollout.backend: vllm`).
"""
from __future__ import annotations

import queue
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.multiprocessing as mp

from tlt.rollout.contract import Capabilities, PerWorkerState, torch_capabilities
from tlt.rollout.batch import RolloutBatch
from tlt.rollout.stats import RolloutStats
from tlt.versions import Synced, bump, version_of, write_weights


def shard_sizes(n_prompts: int, n_workers: int) -> list[int]:
    """Contiguous shard sizes, as equal as possible, no empty shard (fewer workers used instead)."""
    k = max(1, min(n_workers, n_prompts))
    return [n_prompts // k + (1 if i < n_prompts % k else 0) for i in range(k)]


def merge_batches(parts: list[RolloutBatch], group_size: int, wall_s: float, idle_s: float) -> RolloutBatch:
    """Concatenate shard batches (in shard order) into one group-major batch.

    Stats combine with `RolloutStats.merge` (counters add up, `tail_time_s` is the longest tail of
    any worker); `time_s` is the wall-clock of the whole sharded rollout, `worker_idle_s` the
    worker-seconds spent waiting for the slowest shard.
    """
    out = RolloutBatch([], [], [], [], [], [], [], [], stats=RolloutStats(workers=0))
    offset = 0
    for b in parts:
        out.prompt_ids += b.prompt_ids
        out.response_ids += b.response_ids
        out.logprobs += b.logprobs
        out.group_index += [g + offset for g in b.group_index]
        out.finished_eos += b.finished_eos
        out.drafted += b.drafted
        out.accepted += b.accepted
        out.target_passes += b.target_passes
        offset += len(b.response_ids) // group_size
        out.stats = out.stats.merge(b.stats)
    out.stats.time_s, out.stats.worker_idle_s = wall_s, idle_s
    return out


def _worker(rank: int, model_cls, model_config, policy: dict, drafter_args, rollout_json: str, eos_ids, pad_id,
            threads: int, seed: int, versions: dict[str, int], cmd, res) -> None:
    torch.set_num_threads(threads)
    # deferred: this runs in the spawned worker process, which imports only what it decodes with
    from tlt.config import RolloutConfig
    from tlt.rollout.torch_engine.build import build_engine

    cfg = RolloutConfig.model_validate_json(rollout_json)
    model = model_cls(model_config)  # random init once, then every tensor replaced by the shared one
    write_weights(model, policy, assign=True)
    model.eval()
    drafter = None
    if drafter_args is not None:
        from tlt.drafter.model import Eagle3Drafter  # deferred: worker process, only with a drafter

        target_config, vd, aux_ids, state = drafter_args
        drafter = Eagle3Drafter(target_config, model.get_input_embeddings().weight, vd, aux_ids)
        write_weights(drafter, state, assign=True)
        drafter.eval()
    engine = build_engine(model, cfg, eos_ids, pad_id, drafter, seed=seed, rank=rank,
                          calibrate_vocab=model.config.vocab_size)  # on its own share of the cores
    res.put((rank, "ready", engine.calibration))  # the cost curve its bandit starts from (None: none)
    while True:
        msg = cmd.get()
        if msg[0] == "exit":
            return
        if msg[0] == "prior":  # re-price the bandit from this worker's own curve
            engine.set_accept_prior(msg[1])
            res.put((rank, "prior", engine.calibration))
            continue
        prompts, kwargs, now = msg[1], msg[2], msg[3]
        for name, module in (("policy", model), ("drafter", drafter)):
            if now[name] != versions[name]:  # the trainer wrote the shared tensors: this engine's copy is stale
                bump(module)
        versions = now
        t0 = time.perf_counter()
        batch = engine.generate(prompts, **kwargs)
        res.put((rank, "done", (batch, time.perf_counter() - t0)))


class WorkerPool(PerWorkerState):
    """`rollout.workers` engine processes over shared-memory policy/drafter weights."""

    def __init__(self, model, cfg, eos_ids: list[int], pad_id: int, n_workers: int, drafter=None,
                 seed: int = 0, threads: int | None = None):
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("rollout.workers > 1 runs CPU worker processes; on GPUs use rollout.backend: vllm")
        self.cfg, self.n = cfg, n_workers
        self._model, self._drafter = model, drafter if cfg.drafter == "eagle" else None
        model.share_memory()  # in place: the trainer's updates reach the workers with no copy
        self._policy = dict(model.state_dict())
        self._dstate = None
        self._synced = Synced(policy=model, drafter=self._drafter)
        if self._drafter is not None:
            self._drafter.share_memory()
            self._dstate = dict(self._drafter.state_dict())
        threads = threads or max(1, torch.get_num_threads() // n_workers)
        ctx = mp.get_context("spawn")
        self.res = ctx.Queue()
        self.cmds, self.procs = [], []
        dargs = None
        if self._drafter is not None:
            d = self._drafter
            dargs = (model.config, d.draft_vocab_size, d.aux_layer_ids, self._dstate)
        for rank in range(n_workers):
            cmd = ctx.Queue()
            p = ctx.Process(target=_worker, daemon=True, name=f"tlt-rollout-{rank}", args=(
                rank, type(model), model.config, self._policy, dargs, cfg.model_dump_json(), list(eos_ids), pad_id,
                threads, seed, self._versions(), cmd, self.res))
            p.start()
            self.cmds.append(cmd)
            self.procs.append(p)
        self.calibrations: list[dict | None] = [None] * n_workers  # each worker's own cost curve (tlt.rollout.breakeven)
        for _ in range(n_workers):
            rank, _, curve = self._get(300.0)
            self.calibrations[rank] = curve

    def sleep(self) -> dict[str, float]:
        """Nothing to hand to the update: the workers decode from shared host memory."""
        return {}

    @property
    def capabilities(self) -> Capabilities:
        """The workers' torch engines' (each with its own bandit and prompt history), less `fixed_strategy`
        and checkpointed state, which stay in the workers; `on_tail` fires when the first shard is back."""
        return replace(torch_capabilities(self.cfg, self.cfg.tuner, "the worker pool"), fixed_strategy=False,
                       checkpoint="")

    def _versions(self) -> dict[str, int]:
        return {"policy": version_of(self._model), "drafter": version_of(self._drafter)}

    def sync(self, model=None) -> dict[str, float]:
        """When a version moved: copy the tensors whose storage a backend rebound into the shared ones.

        The same hook as the vLLM engine's (called after each policy update, and before every
        rollout); `model` is ignored: the pool always syncs the model it was built on. Returns how
        many tensors were copied."""
        moved = self._synced.moved(policy=self._model, drafter=self._drafter)
        copied = 0
        with torch.no_grad():
            for name, module, shared in (("policy", self._model, self._policy), ("drafter", self._drafter, self._dstate)):
                if name not in moved or module is None:
                    continue
                for k, v in module.state_dict().items():
                    if v.data_ptr() != shared[k].data_ptr():
                        shared[k].copy_(v)
                        copied += 1
        self._synced.take(policy=self._model, drafter=self._drafter)
        return {"rollout/sync_tensors_copied": float(copied)}

    def _broadcast_prior(self, rate: float) -> list[dict | None]:
        """Every worker re-prices its bandit at `rate`; their calibrations after it."""
        for cmd in self.cmds:
            cmd.put(("prior", rate))
        out: list[dict | None] = [None] * self.n
        for _ in range(self.n):
            rank, _, curve = self._get(60.0)
            out[rank] = curve
        return out

    def _get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.res.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rollout worker(s) {', '.join(dead)} ended unexpectedly") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout workers did not answer within {timeout:.0f} s") from None

    def generate(self, prompts: list[list[int]], group_size: int = 1, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 spec: bool | None = None, spec_threshold: int | None = None,
                 on_tail: Callable[[int], None] | None = None) -> RolloutBatch:
        """Same contract as `RolloutEngine.generate`; shard i samples with seed `seed + i`. The tail
        (`on_tail`) starts when the first worker finishes its shard while the others decode on."""
        self.sync()  # weights written outside an RL step's sync (a refresh, a resumed checkpoint)
        sizes = shard_sizes(len(prompts), self.n)
        t0, start = time.perf_counter(), 0
        for i, size in enumerate(sizes):
            kw = dict(group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                      seed=seed + i, spec=spec, spec_threshold=spec_threshold)
            self.cmds[i].put(("generate", prompts[start:start + size], kw, self._versions()))
            start += size
        parts: dict[int, RolloutBatch] = {}
        finished_at: dict[int, float] = {}
        while len(parts) < len(sizes):
            rank, _, (batch, _) = self._get(3600.0)
            parts[rank], finished_at[rank] = batch, time.perf_counter()
            if len(parts) == 1 and len(sizes) > 1 and on_tail is not None:
                on_tail(len(sizes) - 1)  # a worker is idle while the others finish their tails
        wall = time.perf_counter() - t0
        idle = sum(t0 + wall - t for t in finished_at.values())
        return merge_batches([parts[i] for i in range(len(sizes))], group_size, wall, idle)

    def close(self) -> None:
        for cmd, p in zip(self.cmds, self.procs):
            if p.is_alive():
                cmd.put(("exit",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
