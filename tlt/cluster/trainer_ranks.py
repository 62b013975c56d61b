"""The policy update as `trainer.world_size` DeepSpeed ZeRO ranks, one Ray actor each (one process
group over gloo on CPU, NCCL on GPUs), with the same interface as `tlt.rl.update.DeepSpeedUpdater`.

Data parallel: the step's rows are split into equal contiguous shards, one per rank (padded with
rows that carry no response tokens, so every rank runs the same micro-batches). Every rank scales
its loss by the *whole* batch's response-token count over the world size; DeepSpeed averages
gradients over the ranks, so the summed gradient equals world size 1's on the combined batch.
After the step rank 0's weights come back once and are copied into the driver's model (which
the rollout pool then pushes as the next policy version; checkpoints and evaluation read it).
Optimizer state is per rank (ZeRO partitions it): a checkpoint holds one state per rank.
"""
from __future__ import annotations

import os

import ray
import torch

from tlt.cluster.placement import RayPlacement
from tlt.config import RLConfig, TrainerConfig
from tlt.device import resolve_device, to_cpu
from tlt.rl.logprobs import ForwardOut
from tlt.rl.update import DeepSpeedUpdater, PolicyBatch
from tlt.versions import write_weights
from tlt.services import free_port

_NOT_ADDITIVE = ("policy/grad_norm", "policy/lr")  # global values, equal on every rank


class TrainerRank:
    """One DeepSpeed rank: a copy of the policy and a `DeepSpeedUpdater` over it."""

    def __init__(self, rank: int, model_cls, model_config, rl_json: str, trainer_json: str, threads: int):
        torch.set_num_threads(threads)
        self.rank = rank
        trainer = TrainerConfig.model_validate_json(trainer_json)
        # Ray shows a GPU rank its one device (cuda:0), a rank without GPUs none: auto follows that
        self.model = model_cls(model_config).to(resolve_device(trainer.device))
        self.updater = DeepSpeedUpdater(self.model, RLConfig.model_validate_json(rl_json), trainer)

    def rendezvous(self) -> tuple[str, int]:
        """(address, free port) of this rank's node: rank 0 hosts the process group's store."""
        ip = ray.util.get_node_ip_address()
        return ip, free_port("0.0.0.0")

    def join(self, world_size: int, addr: str, port: int, gpus: bool, weights: dict) -> None:
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port),
                          LOCAL_RANK="0" if gpus else str(self.rank))  # Ray shows each GPU actor one device
        write_weights(self.model, weights)

    def step(self, batch: PolicyBatch, aux_layer_ids, want_forwards: bool, denom: float):
        forwards = []

        def on_forward(start: int, mb: PolicyBatch, out: ForwardOut) -> None:  # back to the driver, on its CPU
            forwards.append((start, mb.to("cpu"), ForwardOut(*(None if t is None else t.cpu() for t in (
                out.logp, out.entropy, out.aux, out.last_hidden)))))

        on_forward = on_forward if want_forwards else None
        metrics = self.updater.step(batch, aux_layer_ids=aux_layer_ids, on_forward=on_forward, denom=denom)
        weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()} if self.rank == 0 else None
        return metrics, forwards, weights  # copies on the CPU: not views of DeepSpeed's flat buffers

    def load(self, weights: dict, optim_states: list[dict]) -> None:
        """Resume: the driver's weights, and every rank's optimizer state (each rank takes its own)."""
        write_weights(self.model, weights)
        self.updater.load_state_dict(optim_states)

    def state_dict(self) -> dict:
        return self.updater.state_dict()

    def close(self) -> None:
        self.updater.close()


def _pad_rows(batch: PolicyBatch, rows: int) -> PolicyBatch:
    """`batch` grown to `rows` rows with copies of its first row whose response mask is all False:
    they add nothing to the loss, the gradients or the (token-summed) statistics."""
    extra = rows - len(batch)
    if extra <= 0:
        return batch

    def grow(t: torch.Tensor | None, field: str) -> torch.Tensor | None:
        if t is None:
            return None
        fill = torch.zeros_like(t[:1]) if field in ("response_mask", "advantages") else t[:1]
        return torch.cat([t, fill.expand(extra, *t.shape[1:])])
    return PolicyBatch(*(grow(getattr(batch, f), f) for f in PolicyBatch.__dataclass_fields__))


class RayDeepSpeedUpdater:
    """`trainer.world_size` TrainerRank actors on the placement group's trainer bundles, started
    at the first `step` / `load_state_dict` (so resumed weights are in the model by then)."""

    def __init__(self, placement: RayPlacement, model, rl_cfg: RLConfig, trainer_cfg: TrainerConfig):
        self.placement, self.model, self.rl, self.trainer = placement, model, rl_cfg, trainer_cfg
        self.world_size = trainer_cfg.world_size
        self.ranks: list = []

    def _ensure_ranks(self) -> list:
        if self.ranks:
            return self.ranks
        c, remote = self.placement.cfg, ray.remote(TrainerRank)
        self.ranks = [remote.options(num_cpus=c.trainer_cpus, num_gpus=c.trainer_gpus,
                                     scheduling_strategy=self.placement.strategy(self.placement.trainer_bundle(r))
                                     ).remote(r, type(self.model), self.model.config, self.rl.model_dump_json(),
                                              self.trainer.model_dump_json(), max(1, int(c.trainer_cpus)))
                      for r in range(self.world_size)]
        addr, port = ray.get(self.ranks[0].rendezvous.remote())
        weights = ray.put(to_cpu(self.model.state_dict()))  # the driver's policy may sit on its GPU
        ray.get([r.join.remote(self.world_size, addr, port, c.trainer_gpus > 0, weights) for r in self.ranks])
        return self.ranks

    def step(self, batch: PolicyBatch, aux_layer_ids: list[int] | None = None, on_forward=None) -> dict[str, float]:
        """One data-parallel optimizer step on the whole batch; same metrics as world size 1."""
        ranks = self._ensure_ranks()
        n, per = len(batch), -(-len(batch) // self.world_size)
        padded = _pad_rows(batch, per * self.world_size).to("cpu")  # equal shards: every rank runs the same collectives
        denom = float(batch.response_mask.sum().clamp(min=1)) / self.world_size
        results = ray.get([r.step.remote(padded.slice(i * per, (i + 1) * per), aux_layer_ids, on_forward is not None,
                                         denom) for i, r in enumerate(ranks)])
        write_weights(self.model, results[0][2])  # the rollout pool pushes the new policy version
        if on_forward is not None:
            for i, (_, forwards, _) in enumerate(results):
                for s, mb, out in forwards:
                    keep = min(len(mb), n - (i * per + s))  # padding rows never reach the drafter buffer
                    if keep > 0:
                        on_forward(i * per + s, mb.slice(0, keep), ForwardOut(*(
                            None if t is None else t[:keep] for t in (out.logp, out.entropy, out.aux, out.last_hidden))))
        out = dict(results[0][0])
        for key in out:
            if key not in _NOT_ADDITIVE:
                out[key] = sum(m[key] for m, _, _ in results) / self.world_size
        return out

    def state_dict(self) -> dict:
        return {"world_size": self.world_size, "ranks": ray.get([r.state_dict.remote() for r in self._ensure_ranks()])}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_size") != self.world_size:
            raise ValueError(f"the checkpoint's optimizer state is from trainer.world_size={state.get('world_size')}"
                             f" (ZeRO partitions it per rank); resume with that world size, not {self.world_size}")
        weights = ray.put(to_cpu(self.model.state_dict()))
        states = ray.put(to_cpu(state["ranks"]))
        ray.get([r.load.remote(weights, states) for r in self._ensure_ranks()])

    def close(self) -> None:
        ranks, self.ranks = self.ranks, []
        try:
            if ranks:
                ray.get([r.close.remote() for r in ranks], timeout=60)
        finally:
            for r in ranks:
                ray.kill(r, no_restart=True)
