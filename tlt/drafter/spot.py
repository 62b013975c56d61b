"""Spot trainer: drafter training in the rollout's idle tail (TLT mechanism 2).

A persistent worker process owns a copy of the drafter and its optimizer, with its own thread
budget. When the rollout enters its long tail (few sequences left, the hardware mostly idle),
the rollout's `on_tail` hook starts it; it trains on the online buffer until the rollout ends
and then stops within one drafter step (a tail that ends before the first step still gets that
one step, so a rollout with a tail always refreshes the drafter). Only the trainable weights
come back (selective checkpoint through shared memory; the frozen embedding never moves), and
the rollout engine loads them before the next rollout.

Data and weights cross the process boundary through shared memory (torch.multiprocessing),
never through disk: the target embedding / LM head are shared tensors refreshed in place after
each policy update, the packed batches are shared when sent.

Preemption: the worker may die at any point (OOM kill, a preempted core, SIGKILL). Every
`spot_checkpoint_every` drafter steps (and at the end of each tail) it hands a copy of its
trainable weights + optimizer to a writer thread, which saves an atomic, checksummed checkpoint
(tlt.checkpoint) under `checkpoint_dir`, off the training path. When the main process finds the
worker dead it starts a new one from the newest checkpoint that verifies (a corrupt one is
skipped with a warning and counted in `drafter/corrupt_checkpoints`), or from the weights of the
last completed tail when that is newer: at most the drafter steps since the last checkpoint are
lost (`drafter/steps_lost`, `drafter/preemptions`).
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from tlt.checkpoint import load_checkpoint, load_pt, newest_verified, save_checkpoint, torch_blob
from tlt.config import DrafterConfig
from tlt.device import to_cpu
from tlt.drafter.model import Eagle3Drafter
from tlt.drafter.online import OnlineRefresher, mean_losses
from tlt.drafter.train import DrafterTrainer
from tlt.faults import fault
from tlt.versions import Synced, write_weights

log = logging.getLogger(__name__)


class _CheckpointWriter:
    """Worker-side: saves drafter snapshots on a background thread (newest wins if it falls behind)."""

    def __init__(self, root: Path | None, keep: int = 3):
        self.root, self.keep = root, keep
        self.last_ms = 0.0
        self._pending, self._cv = None, threading.Condition()
        if root is not None:
            threading.Thread(target=self._loop, daemon=True, name="tlt-spot-ckpt").start()

    def submit(self, trainer) -> None:
        if self.root is None:
            return
        snap = trainer.state_dict()  # cloned: training goes on while the thread writes
        with self._cv:
            self._pending = snap
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                snap, self._pending = self._pending, None
            t0 = time.perf_counter()
            save_checkpoint(self.root, snap["num_steps"], {"drafter": snap["drafter"]}, {"num_steps": snap["num_steps"]},
                            {"drafter_optim": torch_blob({"optimizer": snap["optimizer"], "num_steps": snap["num_steps"]})},
                            keep=self.keep)
            self.last_ms = 1000 * (time.perf_counter() - t0)


def _worker(target_config, embed, head, state, dcfg_json: str, vd: int, aux_ids, cmd, res, stop, progress,
            ckpt_dir: str | None, threads: int):
    """Worker loop: ("train", batches) trains until `stop`; ("optim",) / ("load_optim", sd) for checkpoints."""
    torch.set_num_threads(threads)

    cfg = DrafterConfig.model_validate_json(dcfg_json)
    drafter = Eagle3Drafter(target_config, embed, vd, aux_ids)
    write_weights(drafter, state)
    trainer = DrafterTrainer(drafter, cfg, head)
    writer = _CheckpointWriter(Path(ckpt_dir) if ckpt_dir else None)
    res.put(("ready", None))
    while True:
        msg = cmd.get()
        if msg[0] == "exit":
            return
        if msg[0] == "optim":
            res.put(("optim", {"optimizer": trainer.opt.state_dict(), "num_steps": trainer.num_steps}))
        elif msg[0] == "load_optim":
            trainer.opt.load_state_dict(msg[1]["optimizer"])
            trainer.num_steps = progress.value = msg[1]["num_steps"]
        elif msg[0] == "load":
            write_weights(drafter, state)  # main wrote new weights into `state`
        elif msg[0] == "train":
            res.put(("done", _train_until_stop(trainer, drafter, msg[1], state, stop, progress, writer,
                                               cfg.spot_checkpoint_every)))


def _train_until_stop(trainer, drafter, batches, state, stop, progress, writer, every: int) -> dict:
    t0, history = time.perf_counter(), []
    while batches and not (history and stop.is_set()):  # a started tail trains at least one step
        history.append(trainer.step(batches[len(history) % len(batches)]))
        progress.value = trainer.num_steps
        fault("spot", trainer.num_steps)  # TLT_FAULT=spot:N kills this worker at drafter step N
        if every and trainer.num_steps % every == 0:
            writer.submit(trainer)
    t1 = time.perf_counter()
    with torch.no_grad():  # selective checkpoint: trainable weights only, into shared memory
        for k, v in drafter.state_dict().items():
            state[k].copy_(v)
    if history and (not every or trainer.num_steps % every):
        writer.submit(trainer)  # the tail's last steps reach disk too (async; not waited for)
    out = {"drafter/spot_steps": float(len(history)), "drafter/idle_time_used_s": t1 - t0,
           "drafter/checkpoint_ms": 1000 * (time.perf_counter() - t1), "drafter/num_steps": float(trainer.num_steps)}
    if writer.last_ms:
        out["drafter/checkpoint_write_ms"] = writer.last_ms
    return {**out, **mean_losses(history)}


class SpotWorkerDied(RuntimeError):
    """The spot trainer's process ended without being asked to (preempted, killed, crashed)."""


class SpotTrainer(OnlineRefresher):
    """Main-process handle: owns the buffer, feeds the worker, starts/stops it around the tail,
    and restarts it from its last checkpoint when it dies."""

    def __init__(self, model, drafter, cfg, threads: int = 1, seed: int = 0, checkpoint_dir: Path | str | None = None):
        on_cpu = next(drafter.parameters()).device.type == "cpu"  # decoding shares the cores the worker takes
        super().__init__(drafter, cfg, seed, cpus=(os.cpu_count() or 1) if on_cpu else 0)
        self.threads = threads
        self._model = model
        self._embed = model.get_input_embeddings().weight.detach().to("cpu", copy=True).share_memory_()  # CPU worker
        head = model.get_output_embeddings()
        self._tied = head is None or head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        self._head = self._embed if self._tied else head.weight.detach().to("cpu", copy=True).share_memory_()
        self._policy_synced = Synced(policy=model)  # the policy version the shared embedding / head hold
        self.state = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in drafter.state_dict().items()}
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._clear_checkpoints()
        self._ctx = mp.get_context("spawn")
        self._running, self._t_tail = False, 0.0
        self.weights_step = 0  # drafter optimizer steps behind self.drafter's weights
        self._optim: dict | None = None  # the optimizer state last loaded into the worker
        self.preemptions = self.corrupt_checkpoints = 0
        self._recovery: dict[str, float] = {}
        self._spawn()

    def _spawn(self) -> None:
        c = self._ctx
        self.cmd, self.res, self.stop = c.Queue(), c.Queue(), c.Event()
        self.progress = c.Value("q", self.weights_step)
        self.proc = c.Process(target=_worker, daemon=True, name="tlt-spot-trainer", args=(
            self._model.config, self._embed, self._head, self.state, self.cfg.model_dump_json(),
            self.drafter.draft_vocab_size, self.drafter.aux_layer_ids, self.cmd, self.res, self.stop, self.progress,
            str(self.checkpoint_dir) if self.checkpoint_dir else None, self.threads))
        self.proc.start()
        self._get("ready", timeout=300.0)  # pay the worker's start-up (imports) here, not in a tail

    def _clear_checkpoints(self) -> None:
        """Drafter checkpoints of another timeline (before a resume) must never be restored."""
        if self.checkpoint_dir is not None:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)

    def sync_policy(self) -> None:
        """Copy the target embedding / head into the shared tensors the worker reads, when the
        policy's version moved (tlt.versions)."""
        if not self._policy_synced.moved(policy=self._model):
            return
        with torch.no_grad():
            self._embed.copy_(self._model.get_input_embeddings().weight)
            if not self._tied:
                self._head.copy_(self._model.get_output_embeddings().weight)
        self._policy_synced.take(policy=self._model)

    # ---- hooks called by the RL step (the `Refresher` protocol of tlt.rl.step) ---------------
    def before_rollout(self, step: int) -> Callable[[int], None] | None:
        """Refresh the shared target weights; when the schedule makes step `step` due a refresh the
        returned hook (the rollout's `on_tail`) starts training, else this tail stays idle (None)."""
        self.sync_policy()
        return self.start if self.schedule.due(step) else None

    def after_rollout(self) -> dict[str, float]:
        return {**self.finish(), **self.schedule.metrics()}

    def after_update(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics (accept length, tail time) go to the schedule for the next decision."""
        self.schedule.observe(step, metrics)
        return {}

    def start(self, n_running: int = 0) -> None:
        """The rollout entered its tail: train on the buffer until `finish`."""
        if self._running or len(self.buffer) == 0:
            return
        if not self.proc.is_alive():  # died between tails: nothing trained is lost
            self._recover()
        self.stop.clear()
        self.cmd.put(("train", self.buffer.batches(self.cfg.batch_tokens, self.rng)))
        self._running, self._t_tail = True, time.perf_counter()

    def finish(self) -> dict[str, float]:
        """The rollout ended: stop within one drafter step and load the new weights."""
        if not self._running:
            return {"drafter/spot_steps": 0.0, "drafter/steps": float(self.total_steps), **self._take_recovery()}
        self.stop.set()
        t0 = time.perf_counter()
        self._running = False
        try:
            _, metrics = self._get("done")
        except SpotWorkerDied:
            before = self.weights_step
            self._recover()
            metrics = {"drafter/spot_steps": float(self.weights_step - before)}
        else:
            write_weights(self.drafter, self.state)  # the tail's new weights: the rollout engines sync by version
            self.weights_step = int(metrics.pop("drafter/num_steps"))
        self.total_steps += int(metrics["drafter/spot_steps"])
        metrics.update({"drafter/steps": float(self.total_steps), "drafter/stop_wait_s": time.perf_counter() - t0,
                        "drafter/tail_s": time.perf_counter() - self._t_tail,
                        "drafter/buffer_tokens": float(self.buffer.num_tokens), **self._take_recovery()})
        return metrics

    def _take_recovery(self) -> dict[str, float]:
        out, self._recovery = self._recovery, {}
        return out

    def _get(self, kind: str, timeout: float = 600.0):
        """The worker's next answer; SpotWorkerDied as soon as its process is gone."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.res.get(timeout=0.2)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    try:  # it may have answered just before it ended
                        msg = self.res.get(timeout=0.2)
                        break
                    except queue.Empty:
                        raise SpotWorkerDied(f"spot trainer process ended (exit code {self.proc.exitcode}) "
                                             f"while the trainer waited for '{kind}'") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"spot trainer did not answer '{kind}' within {timeout:.0f} s") from None
        if msg[0] != kind:
            raise RuntimeError(f"spot trainer answered '{msg[0]}', expected '{kind}'")
        return msg

    # ---- preemption ----------------------------------------------------------------------------
    def _recover(self) -> None:
        """Start a new worker from the newest verified drafter checkpoint (or the last tail's weights)."""
        t0 = time.perf_counter()
        reached, code = int(self.progress.value), self.proc.exitcode
        self.proc.join(1)
        path, skipped = newest_verified(self.checkpoint_dir) if self.checkpoint_dir else (None, [])
        self.corrupt_checkpoints += len(skipped)
        for bad in skipped:  # kept for inspection, never considered again
            bad.rename(bad.with_name(f"corrupt-{bad.name}"))
        restored = "the last completed tail"
        optim = self._optim
        if path is not None:
            tensors, state, pts = load_checkpoint(path)
            if int(state["num_steps"]) >= self.weights_step:
                write_weights(self.drafter, tensors["drafter"])
                self.weights_step, restored = int(state["num_steps"]), f"checkpoint {path.name}"
            optim = self._optim = load_pt(pts["drafter_optim"])  # older than the weights only if a tail-end save was lost
        with torch.no_grad():
            for k, v in self.drafter.state_dict().items():
                self.state[k].copy_(v)
        self.preemptions += 1
        log.warning("spot trainer process died (exit code %s) at drafter step %d; restarted from %s (step %d): "
                    "%d drafter steps lost%s", code, reached, restored, self.weights_step,
                    max(0, reached - self.weights_step),
                    f"; {len(skipped)} corrupt checkpoint(s) skipped" if skipped else "")
        self._spawn()
        if optim is not None:
            self.cmd.put(("load_optim", {"optimizer": optim["optimizer"], "num_steps": self.weights_step}))
        self._recovery = {"drafter/preemptions": float(self.preemptions),
                          "drafter/corrupt_checkpoints": float(self.corrupt_checkpoints),
                          "drafter/steps_lost": float(max(0, reached - self.weights_step)),
                          "drafter/restart_s": time.perf_counter() - t0}

    # ---- checkpoints: the optimizer lives in the worker -------------------------------------
    def optimizer_state(self) -> dict:
        if not self.proc.is_alive():
            self._recover()
        self.cmd.put(("optim",))
        try:
            return self._get("optim")[1]
        except SpotWorkerDied:
            self._recover()
            self.cmd.put(("optim",))
            return self._get("optim")[1]

    def state_dict(self) -> dict:
        """Drafter weights, the worker's optimizer, buffer, RNG, step count and schedule."""
        optim = self.optimizer_state()
        return {"drafter": self.drafter.state_dict(), "optimizer": optim["optimizer"], "num_steps": optim["num_steps"],
                **self.online_state()}

    def load_state_dict(self, state: dict) -> None:
        self.load(state["drafter"], {"optimizer": state["optimizer"], "num_steps": state["num_steps"]})
        self.load_online_state(state)

    def load(self, drafter_state: dict, optim_state: dict | None) -> None:
        """Weights (and optimizer) from elsewhere, e.g. the warm-start: a new timeline of checkpoints."""
        write_weights(self.drafter, drafter_state)
        with torch.no_grad():
            for k, v in self.drafter.state_dict().items():
                self.state[k].copy_(v)
        self._clear_checkpoints()  # resumed/warm-started weights start a new timeline
        self.cmd.put(("load",))
        if optim_state is not None:
            self.weights_step = int(optim_state["num_steps"])
            self._optim = optim_state = to_cpu(optim_state)  # the worker trains on the CPU
            self.cmd.put(("load_optim", optim_state))

    def close(self) -> None:
        if self.proc.is_alive():
            self.stop.set()
            self.cmd.put(("exit",))
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
