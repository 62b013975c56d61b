"""Policy update backends (plain torch AdamW, DeepSpeed ZeRO 0-2) sharing one loss.

Loss per RL step (GRPO, Shao et al. 2024, with DAPO's clip-higher and token-level mean,
Yu et al. 2025):  policy_loss + kl_coef * k3 KL(pi || pi_ref) - entropy_coef * entropy.
Every term is a mean over all response tokens of the *whole* batch; micro-batches pass that
token count as `denom`, so accumulated gradients equal the full-batch gradient exactly.

Fused old log-probs: both backends take exactly one optimizer step per RL step (micro-batches
accumulated), so the old policy *is* the policy of the update's forward: with
`PolicyBatch.old_logp = None` the loss uses that forward's own detached log-probs (ratio 1,
TRL does the same when it runs one iteration per generation) and the forward can hand the
drafter its hidden states (`on_forward`); the separate no-grad forward disappears.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from tlt.config import RLConfig, RunConfig, TrainerConfig
from tlt.device import module_device
from tlt.precision import autocast
from tlt.rl.grpo import kl_k3, masked_mean, policy_loss
from tlt.rl.logprobs import ForwardOut, forward_logprobs
from tlt.versions import bump

_ADAM_BETAS = (0.9, 0.999)  # torch AdamW's own defaults, spelled out so both backends agree
_ADAM_EPS = 1e-8


@dataclass
class PolicyBatch:
    """One RL step's training data, laid out as `tlt.rl.logprobs.make_batch` builds it.

    input_ids, attention_mask, response_mask [B,T]; old_logp [B,T] (rollout-policy log-probs,
    position-aligned with the tokens), or None = fused: the update's own forward, detached;
    advantages [B]; ref_logp [B,T] when kl_coef > 0.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    old_logp: Tensor | None
    advantages: Tensor
    ref_logp: Tensor | None = None
    position_ids: Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def slice(self, start: int, stop: int) -> "PolicyBatch":
        """Rows [start, stop) of every tensor."""
        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[start:stop]
        return PolicyBatch(*(cut(getattr(self, f)) for f in self.__dataclass_fields__))

    def to(self, device: torch.device | str) -> "PolicyBatch":
        """Every tensor on `device` (no copy for those already there)."""
        return PolicyBatch(*(None if t is None else t.to(device) for t in (getattr(self, f)
                                                                          for f in self.__dataclass_fields__)))

    def trimmed(self) -> "PolicyBatch":
        """Drop trailing columns that are padding in every row (right padding: a micro-batch of
        short responses need not run at the long tail's length)."""
        width = int(self.attention_mask.sum(dim=1).max()) if len(self) else 0

        def cut(t: Tensor | None) -> Tensor | None:
            return t if t is None or t.dim() < 2 else t[:, :width]
        return PolicyBatch(*(cut(getattr(self, f)) for f in self.__dataclass_fields__))


def make_optimizer(params, rl: RLConfig) -> torch.optim.Optimizer:
    """The policy optimizer of both backends (DeepSpeed gets this very instance)."""
    if rl.optimizer == "sgd":
        return torch.optim.SGD(params, lr=rl.lr, momentum=0.0, weight_decay=rl.weight_decay)
    return torch.optim.AdamW(params, lr=rl.lr, betas=_ADAM_BETAS, eps=_ADAM_EPS, weight_decay=rl.weight_decay)


def fuses_old_logprob(cfg: RunConfig) -> bool:
    """Whether an RL step takes its old log-probs (and the drafter's hidden states) from the
    update's own forward. Valid because every update is one optimizer step per RL step; a KL
    reference keeps the separate forward path (its reference log-probs need one anyway)."""
    return cfg.rl.fused_old_logprob and cfg.rl.kl_coef == 0


def micro_batch_loss(model, mb: PolicyBatch, rl: RLConfig, denom: float, aux_layer_ids: list[int] | None = None
                     ) -> tuple[Tensor, dict[str, float], ForwardOut]:
    """Loss of one micro-batch scaled to its share of the full-batch token mean.

    `denom` = response tokens in the full batch. Returns (loss scalar with grad, additive stats:
    summing them over the micro-batches gives the full-batch values, the forward's outputs with
    the hidden states at `aux_layer_ids` when given). `mb.old_logp` None: fused (see module doc).
    """
    out = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_mask, aux_layer_ids=aux_layer_ids,
                           with_entropy=True, position_ids=mb.position_ids)
    mask = mb.response_mask
    old_logp = out.logp.detach() if mb.old_logp is None else mb.old_logp
    loss, st = policy_loss(out.logp, old_logp, mb.advantages, mask, rl.clip_low, rl.clip_high, denom)
    entropy = masked_mean(out.entropy, mask, denom)
    stats = {"policy/clip_ratio": float(st["clip_ratio"]), "policy/approx_kl": float(st["approx_kl"]),
             "policy/entropy": float(entropy.detach())}
    if rl.entropy_coef > 0:
        loss = loss - rl.entropy_coef * entropy
    if mb.ref_logp is not None:
        kl = kl_k3(out.logp, mb.ref_logp, mask, denom)
        stats["policy/ref_kl"] = float(kl.detach())
        if rl.kl_coef > 0:
            loss = loss + rl.kl_coef * kl
    elif rl.kl_coef > 0:
        raise ValueError("rl.kl_coef > 0 needs PolicyBatch.ref_logp (reference-policy log-probs)")
    stats["policy/loss"] = float(loss.detach())
    return loss, stats, out


def _finish_stats(acc: dict[str, float], grad_norm: float, lr: float) -> dict[str, float]:
    """policy/kl is the KL to the reference when one was given, else the drift from the old policy."""
    out = dict(acc)
    out["policy/kl"] = out.pop("policy/ref_kl", out["policy/approx_kl"])
    out["policy/grad_norm"] = float(grad_norm)
    out["policy/lr"] = float(lr)
    return out


OnForward = Callable[[int, PolicyBatch, ForwardOut], None]


def detached(out: ForwardOut) -> ForwardOut:
    """The forward's outputs without their autograd graph, in fp32 whatever the forward computed in
    (what the drafter buffer receives)."""
    return ForwardOut(*(None if t is None else t.detach().float() for t in (out.logp, out.entropy, out.aux,
                                                                             out.last_hidden)))


def _accumulate(model, batch: PolicyBatch, rl: RLConfig, micro: int, backward, before_micro=None,
                aux_layer_ids: list[int] | None = None, on_forward: OnForward | None = None,
                denom: float | None = None, precision: str = "fp32") -> dict:
    """Forward/backward every micro-batch; `backward(loss)` is the backend's backward.

    `precision` (tlt.precision): bf16-mixed runs each forward under bf16 autocast (the backward
    follows the forward's dtypes; the fp32 parameters receive fp32 gradients).

    `on_forward(start, micro_batch, outputs)` sees each micro-batch's detached forward (rows
    start.. of `batch`, trimmed to the micro-batch's width), with hidden states at `aux_layer_ids`.
    `denom`: the loss's token count (default: this batch's response tokens; a data-parallel rank
    passes the whole batch's count over the world size, as its gradients are averaged over ranks).
    """
    if len(batch) == 0:
        raise ValueError("empty PolicyBatch: nothing to update (were all groups filtered out?)")
    if denom is None:
        denom = float(batch.response_mask.sum().clamp(min=1))
    acc: dict[str, float] = {}
    device = module_device(model)  # a batch built elsewhere (the driver, a Ray rank's caller) moves here
    starts = list(range(0, len(batch), micro))
    for i, start in enumerate(starts):
        if before_micro is not None:
            before_micro(i == len(starts) - 1)
        mb = batch.slice(start, start + micro).trimmed().to(device)
        with autocast(precision, mb.input_ids.device):
            loss, stats, out = micro_batch_loss(model, mb, rl, denom, aux_layer_ids)
        backward(loss)
        if on_forward is not None:
            on_forward(start, mb, detached(out))
        for k, v in stats.items():
            acc[k] = acc.get(k, 0.0) + v
    return acc


class TorchUpdater:
    """AdamW on a HF causal LM with micro-batching and gradient clipping (single process); with
    `trainer.precision` bf16-mixed the model's fp32 weights are the master weights (tlt.precision)."""

    def __init__(self, model, rl_cfg: RLConfig, trainer_cfg: TrainerConfig):
        self.model, self.rl, self.trainer = model, rl_cfg, trainer_cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, rl_cfg)

    def step(self, batch: PolicyBatch, aux_layer_ids: list[int] | None = None,
             on_forward: OnForward | None = None) -> dict[str, float]:
        """One optimizer step on the whole batch -> policy/* metrics (on_forward: see `_accumulate`)."""
        was_training = self.model.training
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        acc = _accumulate(self.model, batch, self.rl, self.trainer.micro_batch_size, lambda loss: loss.backward(),
                          aux_layer_ids=aux_layer_ids, on_forward=on_forward, precision=self.trainer.precision)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.trainer.grad_clip)
        self.optimizer.step()
        bump(self.model)  # new policy weights: the rollout engines sync by this version
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train(was_training)
        return _finish_stats(acc, float(grad_norm), self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def close(self) -> None:
        """Nothing to release; present so both backends share one interface."""


def _grad_norm(params) -> float:
    """L2 norm over all parameter gradients (what clip_grad_norm_ reports)."""
    norms = [p.grad.detach().norm() for p in params if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _single_process_env() -> list[str]:
    """Set the world-size-1 rendezvous variables that are missing (else DeepSpeed looks for MPI
    and fails on mpi4py); returns the names it set, so `close()` can unset them."""
    from tlt.services import free_port  # deferred: only a DeepSpeed rendezvous needs it

    wanted = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    added = [k for k in (*wanted, "MASTER_PORT") if k not in os.environ]
    for key in added:
        os.environ[key] = wanted.get(key) or str(free_port())
    return added


def deepspeed_config(trainer: TrainerConfig) -> dict:
    """DeepSpeed config of the policy update: ZeRO `trainer.zero_stage`, our clip. No `bf16` section:
    with trainer.precision bf16-mixed the parameters stay fp32 (the master weights, partitioned by
    ZeRO with the optimizer state) and the forward runs under torch autocast, as with TorchUpdater;
    checkpoints, resume and the rollout sync then see one fp32 model on every backend."""
    return {
        "train_micro_batch_size_per_gpu": trainer.micro_batch_size,
        "gradient_accumulation_steps": 1,  # accumulation boundaries are set by hand per step
        "gradient_clipping": trainer.grad_clip,
        "zero_optimization": {"stage": trainer.zero_stage},
        "zero_allow_untested_optimizer": True,  # our optimizer is torch AdamW (same as TorchUpdater)
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedUpdater:
    """The same update through a DeepSpeed engine (ZeRO 0-2), world size 1 by default on CPU.

    The engine is built on the first call that needs it and released by `close()` (which also
    destroys the process group this object created), so several can live in one test session.
    Load resumed policy weights into `model` before the first `step()`: ZeRO keeps its own fp32
    master copy from then on (`load_state_dict` refreshes it from the model).
    """

    def __init__(self, model, rl_cfg: RLConfig, trainer_cfg: TrainerConfig):
        self.model, self.rl, self.trainer = model, rl_cfg, trainer_cfg
        self.engine = None
        self._owns_process_group = False
        self._env_added: list[str] = []

    def _ensure_engine(self):
        if self.engine is not None:
            return self.engine
        import deepspeed  # heavy import, only on this backend
        import torch.distributed as dist  # deferred with deepspeed, as above

        self._env_added = _single_process_env()
        # At world size 1 the shm collective op is useless and its JIT build takes ~65 s.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self._owns_process_group = not dist.is_initialized()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=make_optimizer(params, self.rl),
                                               config=deepspeed_config(self.trainer))
        return self.engine

    def step(self, batch: PolicyBatch, aux_layer_ids: list[int] | None = None,
             on_forward: OnForward | None = None, denom: float | None = None) -> dict[str, float]:
        """One optimizer step on the whole batch -> policy/* metrics (on_forward, denom: see `_accumulate`)."""
        engine = self._ensure_engine()
        was_training = self.model.training
        engine.train()
        acc = _accumulate(engine, batch, self.rl, self.trainer.micro_batch_size,
                          lambda loss: engine.backward(loss), engine.set_gradient_accumulation_boundary,
                          aux_layer_ids=aux_layer_ids, on_forward=on_forward, denom=denom,
                          precision=self.trainer.precision)
        # ZeRO 1/2 record the pre-clip norm; stage 0 clips without keeping it, so measure it here.
        grad_norm = _grad_norm(self.model.parameters()) if self.trainer.zero_stage == 0 else None
        engine.step()
        bump(self.model)  # written through ZeRO's flat buffers: only this version tells the engines
        engine.train(was_training)
        if grad_norm is None:
            grad_norm = engine.get_global_grad_norm()
        return _finish_stats(acc, float("nan") if grad_norm is None else float(grad_norm), engine.get_lr()[0])

    def state_dict(self) -> dict:
        """Optimizer state, reduced to what `torch.load(weights_only=True)` accepts."""
        return _plain(self._ensure_engine().optimizer.state_dict())

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """`state`: this rank's `state_dict()`, or (data parallel, tlt.cluster) every rank's, in rank order."""
        engine = self._ensure_engine()
        states = state if isinstance(state, list) else [state]
        if self.trainer.zero_stage == 0:
            engine.optimizer.load_state_dict(states[int(os.environ.get("RANK", "0"))])
        else:
            # fp32 master weights are refreshed from the model's parameters: loading optimizer
            # state never changes the weights (same as TorchUpdater). ZeRO picks its rank's entry.
            engine.optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=False)

    def close(self) -> None:
        """Release the engine and the process group it created (idempotent)."""
        if self.engine is None:
            return
        import deepspeed.comm as ds_dist  # deferred: heavy import, only on this backend
        import torch.distributed as dist  # deferred with deepspeed, as above

        self.engine.destroy()
        self.engine = None
        if self._owns_process_group and dist.is_initialized():
            ds_dist.destroy_process_group()  # also drops DeepSpeed's cached group handles
        self._owns_process_group = False
        for key in self._env_added:
            os.environ.pop(key, None)
        self._env_added = []


# ZeRO state-dict entries left out: the loss scaler (a Python object; the identity in fp32), the
# slice mappings (objects, rebuilt by the engine) and the fp32 master copy of the weights (a
# second copy of the model; masters are refreshed from the model's parameters on load).
_ZERO_OBJECT_KEYS = ("loss_scaler", "param_slice_mappings", "single_partition_of_fp32_groups")


def _plain(state):
    """Recursively turn a (ZeRO) optimizer state dict into tensors, numbers, strings and containers."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items() if k not in _ZERO_OBJECT_KEYS}
    if isinstance(state, (list, tuple)):
        return type(state)(_plain(v) for v in state)
    if isinstance(state, bool) or state is None or isinstance(state, (Tensor, str)):
        return state
    if isinstance(state, int):
        return int(state)  # IntEnum (ZeroStageEnum) -> int
    if isinstance(state, float):
        return float(state)
    raise TypeError(f"optimizer state holds a {type(state).__name__}; it cannot be saved with weights_only")


def make_updater(model, cfg: RunConfig) -> TorchUpdater | DeepSpeedUpdater:
    """The update backend named by `cfg.trainer.backend`."""
    cls = DeepSpeedUpdater if cfg.trainer.backend == "deepspeed" else TorchUpdater
    return cls(model, cfg.rl, cfg.trainer)
