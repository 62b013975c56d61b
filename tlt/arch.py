"""The target architectures tlt trains with a drafter, and everything that differs between them.

One place for what the drafter, the torch engine, the export and the preflight need to know about
a target's architecture (its `config.model_type`): whether it is supported at all, whether vLLM
serves it as an EAGLE-3 target, its RoPE (per layer type in Gemma 3, partial in Phi), its
sliding-window layers, its norms (Gemma's `1 + weight`) and its fused projections (Phi-3's
`qkv_proj` / `gate_up_proj`). Cheap to import: torch and transformers are imported where used.
"""
from __future__ import annotations

from dataclasses import dataclass

from tlt.errors import UserError

FULL, SLIDING = "full_attention", "sliding_attention"


class ArchError(UserError):
    """A target whose architecture tlt cannot train or export with a drafter; the message says why."""


@dataclass(frozen=True)
class Arch:
    """One row of the support matrix (docs/getting-started.md renders it with what each row needs).
    `tiny`: the name of its tiny random model (`tiny:<name>`); `vllm`: None when vLLM serves this
    architecture as an EAGLE-3 target, else the reason it does not."""

    model_type: str
    name: str
    tiny: str
    vllm: str | None = None


_NO_EAGLE3 = ("vLLM {v}'s {cls} does not implement SupportsEagle3: its engine stops with 'Model does not support "
              "EAGLE3 interface but aux_hidden_state_outputs was requested'")
MATRIX: dict[str, Arch] = {a.model_type: a for a in (
    Arch("llama", "Llama (Llama 2/3, SmolLM2)", "llama"),
    Arch("qwen2", "Qwen2 / Qwen2.5", "qwen2"),
    Arch("qwen3", "Qwen3 (dense)", "qwen3"),
    Arch("mistral", "Mistral", "mistral"),
    Arch("gemma3_text", "Gemma 3 (text)", "gemma3",
         vllm=_NO_EAGLE3.format(v="0.32", cls="Gemma3ForCausalLM")),
    Arch("phi3", "Phi-3 / Phi-4-mini", "phi3"),
    Arch("olmo2", "OLMo 2", "olmo2"),  # vLLM serves it through its Transformers backend
    Arch("granite", "Granite 3", "granite"),
    Arch("qwen3_moe", "Qwen3-MoE", "qwen3_moe"),
)}
TINY = {a.tiny: a.model_type for a in MATRIX.values()}


def supported_names() -> str:
    return ", ".join(f"{a.name} ({a.model_type})" for a in MATRIX.values())


def arch_of(config) -> Arch:
    """The matrix row of a target config; ArchError for an architecture outside the matrix."""
    kind = getattr(config, "model_type", None)
    if kind == "gemma3":  # Gemma 3 4B and larger: vision tower + language model in one checkpoint
        raise ArchError("model architecture 'gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); tlt "
                        "trains text models. Save its language model as a text checkpoint (Gemma3ForCausalLM, "
                        "model_type gemma3_text) with save_pretrained and pass that folder, or use a text-only Gemma 3 "
                        "(270M, 1B).")
    if kind not in MATRIX:
        archs = getattr(config, "architectures", None) or [kind]
        raise ArchError(
            f"model architecture '{kind}' ({', '.join(map(str, archs))}) is not one tlt trains with a drafter: the "
            f"EAGLE-3 drafter, the torch engine's cache and the export are tested for {supported_names()} only. "
            "Use a model of one of these architectures (docs/getting-started.md lists what each needs).")
    return MATRIX[kind]


def vllm_reason(config) -> str | None:
    """None when vLLM loads an EAGLE-3 drafter for this target, else why not."""
    return arch_of(config).vllm


def require_vllm_eagle3(config, what: str) -> None:
    """ArchError when vLLM cannot serve this target with an EAGLE-3 drafter (`what` names the setting)."""
    reason = vllm_reason(config)
    if reason:
        a = arch_of(config)
        raise ArchError(f"{what}: {a.name} ({a.model_type}) targets are not served with an EAGLE-3 drafter by vLLM: "
                        f"{reason}. Use rollout.backend: torch (the torch engine speculates with the drafter on "
                        "this architecture), or rollout.drafter: ngram with vLLM.")


# ---------------------------------------------------------------- RoPE
def rope_parameters(config) -> dict:
    """The target's RoPE settings as one dict (transformers 5 `rope_parameters`, or legacy keys);
    per-layer-type settings (Gemma 3) stay keyed by layer type."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def per_layer_type(params: dict) -> bool:
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def drafter_rope(config) -> dict:
    """The RoPE of the drafter's one (full-attention) layer, as the export writes it: the full-attention
    entry of a per-layer-type dict (Gemma 3's global layers), partial_rotary_factor kept only below 1."""
    params = rope_parameters(config)
    if per_layer_type(params):
        params = dict(params.get(FULL) or next(iter(params.values())))
    factor = params.pop("partial_rotary_factor", None) or getattr(config, "partial_rotary_factor", None) or 1.0
    params.setdefault("rope_type", "default")
    if float(factor) != 1.0:
        params["partial_rotary_factor"] = float(factor)
    return params


def rope_layer_type(config) -> str | None:
    """The `layer_type` argument transformers' RoPE init functions need for the drafter's layer."""
    return FULL if per_layer_type(rope_parameters(config)) else None


# ---------------------------------------------------------------- sliding windows
def sliding_window(config) -> tuple[int | None, bool]:
    """(window, per_type): the sliding window of the target's sliding layers (None: none slide) and
    whether the model takes one mask per layer type (a dict) rather than one mask for all layers."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return (window if SLIDING in types else None), True
    return window, False


def layer_masks(config, mask, q_pos, key_pos):
    """The attention mask(s) to pass the target: `mask` [B,1,Q,S] bool as is, or with the sliding
    window applied (a key is seen when its position > query position - window, as transformers'
    sliding_window_overlay) for the sliding layers; a dict by layer type where the model takes one.

    q_pos [B,Q]: the queries' RoPE positions; key_pos [B,S]: every key slot's position.
    """
    window, per_type = sliding_window(config)
    if window is None:
        return mask
    near = key_pos[:, None, None, :] > q_pos[:, None, :, None] - window
    slide = mask & near
    if not per_type:
        return slide
    return {FULL: mask, SLIDING: slide}


# ---------------------------------------------------------------- weights the drafter reuses
def decoder_layers(model):
    """The target's decoder layers, wherever the architecture keeps them."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner.layers
    get = getattr(model, "get_decoder", None)
    if get is not None and hasattr(get(), "layers"):
        return get().layers
    raise ArchError(f"cannot find the decoder layers of {type(model).__name__}; {supported_names()} are supported.")


def final_norm(model):
    inner = getattr(model, "model", None)
    return getattr(inner, "norm", None)


def norm_scale(norm, config):
    """The multiplicative weight of an RMSNorm module: Gemma's norms compute x * (1 + weight)."""
    w = norm.weight.detach().float()
    return 1.0 + w if getattr(config, "model_type", "").startswith("gemma") else w


def attn_weights(layer, config):
    """(q, k, v) projection weights of a decoder layer; Phi-3 fuses them in one qkv_proj."""
    attn = layer.self_attn
    if hasattr(attn, "qkv_proj"):
        heads = config.num_attention_heads
        hd = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = (getattr(config, "num_key_value_heads", None) or heads) * hd
        return attn.qkv_proj.weight.split([heads * hd, kv, kv], dim=0)
    return attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight


def mlp_weights(layer):
    """(gate, up, down) weights of a dense MLP (Phi-3's gate_up_proj split), None for a mixture of experts."""
    mlp = layer.mlp
    if hasattr(mlp, "gate_up_proj") and getattr(mlp.gate_up_proj, "weight", None) is not None:
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
        return gate, up, mlp.down_proj.weight
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    return None


def layer_norms(layer, config):
    """(norm before attention, norm before the MLP) of a pre-norm layer as effective weights; None for
    a norm the layer does not have there (OLMo 2 normalises after attention and MLP instead)."""
    pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)  # Gemma: post_attention_layernorm is a post-norm
    if pre_mlp is None and getattr(config, "model_type", "") != "olmo2":
        pre_mlp = getattr(layer, "post_attention_layernorm", None)
    pre_attn = getattr(layer, "input_layernorm", None)
    return tuple(None if n is None else norm_scale(n, config) for n in (pre_attn, pre_mlp))


# ---------------------------------------------------------------- the target's logits
def logit_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) the target applies to its LM head's output: Granite divides by logits_scaling,
    Gemma 2-style models soft-cap (cap * tanh(x / cap)). The drafter's teacher distribution needs both."""
    scale = 1.0 / float(getattr(config, "logits_scaling", None) or 1.0)
    cap = getattr(config, "final_logit_softcapping", None)
    return scale, (float(cap) if cap else None)
