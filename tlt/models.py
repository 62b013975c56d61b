"""Target models: the bundled SmolLM2, local HF directories, hub ids (online only), tiny random models.

Tiny models use a byte-level tokenizer built in memory (no files, no hub) with the same
ChatML template as SmolLM2, and head_dim 64 so that vLLM's CPU attention can load them.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)

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


def tiny_model(arch: str = "llama", layers: int = 4, hidden: int = 128, vocab: int = 512,
               seed: int = 0) -> PreTrainedModel:
    """A random Llama or Qwen2 causal LM built from a fresh config (fp32, eval mode).

    head_dim is 64 (vLLM CPU supports it); KV heads = heads // 2 to exercise GQA. The final
    norm gets non-unit weights so that a wrong or missing norm in an export changes outputs.
    """
    heads = max(2, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny architecture '{arch}'; use 'llama' or 'qwen2'")
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
        # Larger init than HF's default 0.02 so that random models have peaked, varied distributions.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model.eval()
