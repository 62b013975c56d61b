"""Spot trainer: drafter training in the rollout's idle tail (TLT mechanism 2).

A persistent worker process owns a copy of the drafter and its optimizer, with its own thread
budget. When the rollout enters its long tail (few sequences left, the hardware mostly idle),
the engine's `on_tail` hook starts it; it trains on the online buffer until the rollout ends
and then stops within one drafter step. Only the trainable weights come back (selective
checkpoint through shared memory; the frozen embedding never moves), and the rollout engine
loads them before the next rollout.

Data and weights cross the process boundary through shared memory (torch.multiprocessing),
never through disk: the target embedding / LM head are shared tensors refreshed in place after
each policy update, the packed batches are shared when sent.
"""
from __future__ import annotations

import queue
import time

import torch
import torch.multiprocessing as mp

from tlt.drafter.buffer import DraftBuffer

_METRICS = ("drafter/loss", "drafter/loss_feature", "drafter/loss_token", "drafter/top1_acc")


def _worker(target_config, embed, head, state, dcfg_json: str, vd: int, aux_ids, cmd, res, stop, threads: int):
    """Worker loop: ("train", batches) trains until `stop`; ("optim",) / ("load_optim", sd) for checkpoints."""
    torch.set_num_threads(threads)
    from tlt.config import DrafterConfig
    from tlt.drafter.model import Eagle3Drafter
    from tlt.drafter.train import DrafterTrainer

    drafter = Eagle3Drafter(target_config, embed, vd, aux_ids)
    drafter.load_state_dict(state, strict=True)
    trainer = DrafterTrainer(drafter, DrafterConfig.model_validate_json(dcfg_json), head)
    res.put(("ready", None))
    while True:
        msg = cmd.get()
        if msg[0] == "exit":
            return
        if msg[0] == "optim":
            res.put(("optim", {"optimizer": trainer.opt.state_dict(), "num_steps": trainer.num_steps}))
        elif msg[0] == "load_optim":
            trainer.opt.load_state_dict(msg[1]["optimizer"])
            trainer.num_steps = msg[1]["num_steps"]
        elif msg[0] == "load":
            drafter.load_state_dict(state, strict=True)  # main wrote new weights into `state`
        elif msg[0] == "train":
            res.put(("done", _train_until_stop(trainer, drafter, msg[1], state, stop)))


def _train_until_stop(trainer, drafter, batches, state, stop) -> dict:
    t0, history = time.perf_counter(), []
    while batches and not stop.is_set():
        history.append(trainer.step(batches[len(history) % len(batches)]))
    t1 = time.perf_counter()
    with torch.no_grad():  # selective checkpoint: trainable weights only, into shared memory
        for k, v in drafter.trainable_state_dict().items():
            state[k].copy_(v)
    out = {"drafter/spot_steps": float(len(history)), "drafter/idle_time_used_s": t1 - t0,
           "drafter/checkpoint_ms": 1000 * (time.perf_counter() - t1)}
    for key in _METRICS:
        vals = [h[key] for h in history if key in h]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


class SpotTrainer:
    """Main-process handle: owns the buffer, feeds the worker, starts/stops it around the tail."""

    def __init__(self, model, drafter, cfg, threads: int = 1, seed: int = 0):
        self.drafter, self.cfg = drafter, cfg
        self.buffer = DraftBuffer(cfg.buffer_steps, cfg.buffer_max_tokens)
        self.rng = torch.Generator().manual_seed(seed)
        self._model = model
        self._embed = model.get_input_embeddings().weight.detach().clone().share_memory_()
        head = model.get_output_embeddings()
        self._tied = head is None or head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        self._head = self._embed if self._tied else head.weight.detach().clone().share_memory_()
        self.state = {k: v.detach().clone().share_memory_() for k, v in drafter.trainable_state_dict().items()}
        ctx = mp.get_context("spawn")
        self.cmd, self.res, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=_worker, daemon=True, name="tlt-spot-trainer", args=(
            model.config, self._embed, self._head, self.state, cfg.model_dump_json(), drafter.draft_vocab_size,
            drafter.aux_layer_ids, self.cmd, self.res, self.stop, threads))
        self.proc.start()
        self._get("ready", timeout=300.0)  # pay the worker's start-up (imports) here, not in a tail
        self.total_steps, self._running, self._t_tail = 0, False, 0.0

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.drafter.aux_layer_ids

    def add_rollouts(self, step: int, ids, attn, resp, aux, last_hidden) -> None:
        """Rows of the old-log-prob forward [B,T,...] (right padded) -> buffer samples."""
        self.buffer.add_rows(step, ids, attn, resp, aux, last_hidden)

    def sync_policy(self) -> None:
        """Copy the (updated) target embedding / head into the shared tensors the worker reads."""
        with torch.no_grad():
            self._embed.copy_(self._model.get_input_embeddings().weight)
            if not self._tied:
                self._head.copy_(self._model.get_output_embeddings().weight)

    # ---- hooks called by the RL step (same interface as DrafterRefresher) --------------------
    def before_rollout(self, engine) -> None:
        self.sync_policy()
        engine.on_tail = self.start

    def after_rollout(self, engine) -> dict[str, float]:
        engine.on_tail = None
        return self.finish()

    def after_update(self, step: int, accept_len: float | None) -> dict[str, float]:
        return {}

    def start(self, n_running: int = 0) -> None:
        """The rollout entered its tail: train on the buffer until `finish`."""
        if self._running or len(self.buffer) == 0:
            return
        self.stop.clear()
        self.cmd.put(("train", self.buffer.batches(self.cfg.batch_tokens, self.rng)))
        self._running, self._t_tail = True, time.perf_counter()

    def finish(self) -> dict[str, float]:
        """The rollout ended: stop within one drafter step and load the new weights."""
        if not self._running:
            return {"drafter/spot_steps": 0.0, "drafter/steps": float(self.total_steps)}
        self.stop.set()
        t0 = time.perf_counter()
        _, metrics = self._get("done")
        self._running = False
        with torch.no_grad():
            self.drafter.load_state_dict(self.state, strict=True)
        self.total_steps += int(metrics["drafter/spot_steps"])
        metrics.update({"drafter/steps": float(self.total_steps), "drafter/stop_wait_s": time.perf_counter() - t0,
                        "drafter/tail_s": time.perf_counter() - self._t_tail,
                        "drafter/buffer_tokens": float(self.buffer.num_tokens)})
        return metrics

    def _get(self, kind: str, timeout: float = 600.0):
        try:
            msg = self.res.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"spot trainer did not answer '{kind}' within {timeout:.0f} s "
                               f"(alive: {self.proc.is_alive()})") from None
        if msg[0] != kind:
            raise RuntimeError(f"spot trainer answered '{msg[0]}', expected '{kind}'")
        return msg

    # ---- checkpoints: the optimizer lives in the worker -------------------------------------
    def optimizer_state(self) -> dict:
        self.cmd.put(("optim",))
        return self._get("optim")[1]

    def load(self, drafter_state: dict, optim_state: dict | None) -> None:
        with torch.no_grad():
            self.drafter.load_state_dict(drafter_state, strict=True)
            for k, v in self.drafter.trainable_state_dict().items():
                self.state[k].copy_(v)
        self.cmd.put(("load",))
        if optim_state is not None:
            self.cmd.put(("load_optim", optim_state))

    def close(self) -> None:
        if self.proc.is_alive():
            self.stop.set()
            self.cmd.put(("exit",))
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
