"""Export the drafter as an EAGLE-3 directory that vLLM and SGLang load.

One format for every target (Llama-style even for Qwen targets): `config.json` with every
number copied from the target, and `model.safetensors` whose keys are exactly the drafter's
trainable state dict (no `model.` prefix, no biases, d2t int64, t2d bool).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tlt.atomic import staged_dir
from tlt.arch import drafter_rope
from tlt.drafter.model import Eagle3Drafter
from tlt.errors import UserError
from tlt.versions import write_weights

CONFIG, WEIGHTS = "config.json", "model.safetensors"
_NORMS = ["midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
          "midlayer.post_attention_layernorm.weight", "norm.weight"]


class ExportError(UserError):
    """An export or load problem, phrased for the user (what is wrong and what to do)."""


def _dims(cfg) -> dict:
    heads = cfg.num_attention_heads
    return {"H": cfg.hidden_size, "V": cfg.vocab_size, "I": cfg.intermediate_size, "nH": heads,
            "nKV": getattr(cfg, "num_key_value_heads", None) or heads,
            "hd": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads}


def expected_shapes(target_config, draft_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Exact key -> shape map of an EAGLE-3 export for this target (the EAGLE-3 weights vLLM's llama_eagle3 loader expects)."""
    d = _dims(target_config)
    H, I, q, kv = d["H"], d["I"], d["nH"] * d["hd"], d["nKV"] * d["hd"]
    shapes = {name: (H,) for name in _NORMS}
    shapes.update({
        "fc.weight": (H, 3 * H), "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H), "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q), "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I),
        "lm_head.weight": (draft_vocab_size, H)})
    if draft_vocab_size != d["V"]:
        # vLLM creates its d2t parameter only for a reduced vocabulary and refuses one otherwise.
        shapes.update({"d2t": (draft_vocab_size,), "t2d": (d["V"],)})
    return shapes


def rope_keys(target_config) -> tuple[dict, dict]:
    """(legacy RoPE keys, extra keys) of the export's config.json: the drafter's RoPE (tlt.arch.drafter_rope:
    the full-attention layers' of a per-layer-type target) as rope_theta / rope_scaling, and a partial
    rotary factor below 1 as the top-level key engines read."""
    rope = drafter_rope(target_config)
    theta = rope.pop("rope_theta", 10000.0)
    factor = rope.pop("partial_rotary_factor", None)
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}, ({"partial_rotary_factor": factor} if factor else {})


def eagle3_config(drafter: Eagle3Drafter, target_config, dtype: torch.dtype) -> dict:
    """config.json content: numbers from the target, legacy rope keys, both layer-id conventions."""
    d = _dims(target_config)
    rope, extra = rope_keys(target_config)
    ids = [int(i) for i in drafter.aux_layer_ids]
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": d["H"], "intermediate_size": d["I"], "num_hidden_layers": 1,
        "num_attention_heads": d["nH"], "num_key_value_heads": d["nKV"], "head_dim": d["hd"],
        "hidden_act": getattr(target_config, "hidden_act", "silu"),
        "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
        "vocab_size": d["V"], "draft_vocab_size": drafter.draft_vocab_size, "target_hidden_size": d["H"],
        "max_position_embeddings": target_config.max_position_embeddings,
        **rope, **extra,
        "attention_bias": False, "mlp_bias": False, "bias": False,
        "tie_word_embeddings": False, "norm_before_residual": False,
        # vLLM reads the top-level ids as HF hidden_states ids; SGLang reads the nested ones + 1.
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_eagle3(drafter: Eagle3Drafter, target_config, out_dir: str | Path, force: bool = False,
                  dtype: torch.dtype | None = None) -> Path:
    """Write `out_dir` (config.json + model.safetensors) atomically; returns its path.

    dtype: floating weights' dtype on disk (default: the drafter's). Refuses a non-empty
    out_dir unless force=True; the old directory is replaced only once the new one is complete.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(
            f"export directory '{out}' exists and is not empty. Exporting would overwrite what is there "
            f"(perhaps a previous drafter that a server still loads). Pass force=True (export.force / --force) "
            f"to replace it atomically, or choose an empty out_dir.")
    dtype = dtype or drafter.fc.weight.dtype
    if target_config.num_hidden_layers in drafter.aux_layer_ids:
        warnings.warn("aux id N = HF's final hidden state after the norm; vLLM reads id N before the norm")
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in drafter.state_dict().items()}
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    if drafter.draft_vocab_size == drafter.vocab_size:  # full vocabulary: identity maps are implied
        del tensors["d2t"], tensors["t2d"]
    config = eagle3_config(drafter, target_config, dtype)
    with staged_dir(out, prefix=f".{out.name}.tmp-") as tmp:  # the old export stays until this one checks out
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        problems = check_export(tmp, target_config)
        if problems:
            raise ExportError("export failed its own checks: " + "; ".join(problems))
    return out


# ---- checks ---------------------------------------------------------------------------------
def _check_keys(tensors: dict, target_config, Vd: int) -> list[str]:
    problems = []
    want = expected_shapes(target_config, Vd)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing:
        problems.append(f"missing weights {missing}")
    if extra:
        problems.append(f"unexpected weights {extra} (engines load exactly the EAGLE-3 key set)")
    for k in sorted(set(want) & set(tensors)):
        if tuple(tensors[k].shape) != want[k]:
            problems.append(f"{k} has shape {tuple(tensors[k].shape)}, expected {want[k]}")
    return problems


def _check_vocab(tensors: dict, V: int, Vd: int) -> list[str]:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None:
        return []
    problems = []
    if d2t.dtype != torch.int64 or d2t.numel() != Vd:
        problems.append(f"d2t must be int64 of length {Vd}, is {d2t.dtype} of length {d2t.numel()}")
    ids = torch.arange(d2t.numel()) + d2t.long()
    if d2t.numel() and not (bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < V):
        problems.append(f"arange(Vd) + d2t must be strictly increasing target ids in [0, {V})")
    if t2d.dtype != torch.bool or int(t2d.sum()) != Vd:
        problems.append(f"t2d must be bool with sum == draft_vocab_size {Vd}, is {t2d.dtype} with sum {int(t2d.sum())}")
    elif d2t.numel() and int(ids[-1]) < V and not bool(t2d[ids.clamp(0, V - 1)].all()):
        problems.append("t2d does not mark the target ids that d2t maps to")
    return problems


def _check_config(path: Path, raw: dict, target_config) -> list[str]:
    try:
        loaded = AutoConfig.from_pretrained(str(path))
    except Exception as err:  # any parse failure is a problem to report, not to raise
        return [f"config.json does not load with transformers.AutoConfig: {err}"]
    problems = []
    if drafter_rope(loaded) != drafter_rope(target_config):
        problems.append(f"RoPE {drafter_rope(loaded)} differs from the target's {drafter_rope(target_config)}")
    if loaded.max_position_embeddings != target_config.max_position_embeddings:
        problems.append(f"max_position_embeddings {loaded.max_position_embeddings} != target's "
                        f"{target_config.max_position_embeddings}")
    if raw.get("architectures") != ["LlamaForCausalLMEagle3"] or raw.get("bias") is not False:
        problems.append("config needs architectures ['LlamaForCausalLMEagle3'] and bias: false")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not top or nested is None or [i - 1 for i in top] != list(nested):
        problems.append(f"aux layer ids: top-level {top} must equal nested {nested} + 1")
    return problems


def check_export(path: str | Path, target_config) -> list[str]:
    """Format checks: key set and shapes, vocab maps, config. Empty list = ok."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        return [f"'{path}' needs {CONFIG} and {WEIGHTS}"]
    raw = json.loads((path / CONFIG).read_text())
    tensors = load_file(str(path / WEIGHTS))
    Vd = raw.get("draft_vocab_size")
    if Vd is None:
        return ["config.json lacks draft_vocab_size (SGLang reads it)"]
    problems = _check_keys(tensors, target_config, Vd)
    problems += _check_vocab(tensors, target_config.vocab_size, Vd)
    return problems + _check_config(path, raw, target_config)


# ---- load -----------------------------------------------------------------------------------
def load_eagle3(path: str | Path, target_model) -> Eagle3Drafter:
    """Rebuild a drafter from an export for `target_model` (embedding shared from the target)."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise ExportError(f"'{path}' is not an EAGLE-3 export (no {CONFIG}); pass the directory export_eagle3 wrote")
    raw = json.loads((path / CONFIG).read_text())
    tc = target_model.config
    mine = (raw.get("hidden_size"), raw.get("vocab_size"))
    if mine != (tc.hidden_size, tc.vocab_size) or raw.get("target_hidden_size") != tc.hidden_size:
        raise ExportError(f"drafter made for hidden {mine[0]} / vocab {mine[1]}, target has hidden "
                          f"{tc.hidden_size} / vocab {tc.vocab_size}; load it with the target it was trained "
                          f"for, or train and export a drafter for this target")
    problems = check_export(path, tc)
    if problems:
        raise ExportError(f"'{path}' does not match this target: " + "; ".join(problems))
    embed = target_model.get_input_embeddings().weight
    drafter = Eagle3Drafter(tc, embed, raw["draft_vocab_size"], raw["eagle_aux_hidden_state_layer_ids"])
    state = load_file(str(path / WEIGHTS))
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    state.setdefault("d2t", drafter.d2t)  # full-vocabulary exports ship no maps (identity)
    state.setdefault("t2d", drafter.t2d)
    write_weights(drafter, state)
    head = target_model.get_output_embeddings()
    drafter.target_head = (head.weight if head is not None else embed).detach()
    return drafter.to(embed.device)
