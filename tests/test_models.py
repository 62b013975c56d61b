"""Target loading: tiny random models, local folders (safetensors only), hub ids offline, bundled SmolLM2."""
from __future__ import annotations

import time

import pytest
import torch

from tlt.config import ModelConfig
from tlt.models import (CHATML, ModelError, bundled_smollm2_dir, eos_token_ids, load_target, load_tokenizer,
                        resolve_cache_dir, tiny_model, tiny_tokenizer)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_target_builds(arch):
    cfg = ModelConfig(name_or_path=f"tiny:{arch}", tiny_layers=2, tiny_hidden=128, tiny_vocab=300)
    model, tok = load_target(cfg)
    assert model.config.model_type == arch
    assert model.config.head_dim == 64 and model.config.num_hidden_layers == 2
    assert not model.training and model.dtype == torch.float32
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()


def test_tiny_dtype_from_config():
    model, _ = load_target(ModelConfig(name_or_path="tiny:llama", tiny_layers=1, dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_tiny_tokenizer_round_trip_and_chat_template():
    tok = tiny_tokenizer()
    text = "What is 2+3? Ünïcode → 5"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template == CHATML
    assert eos_token_ids(tok, tiny_model(layers=1)) == [2]


def test_local_dir_loads_back_identical(tmp_path):
    model = tiny_model("qwen2", layers=2)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, tok = load_target(ModelConfig(name_or_path=str(tmp_path)))
    ids = torch.tensor([[3, 40, 41, 42, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert not loaded.training and tok.pad_token_id == 0 and loaded.config.pad_token_id == 0
    assert load_tokenizer(ModelConfig(name_or_path=str(tmp_path))).chat_template == CHATML


def test_bin_only_dir_refused(tmp_path):
    tiny_model(layers=1).save_pretrained(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelError, match=r"no \*\.safetensors.*pytorch_model\.bin.*safe_serialization"):
        load_target(ModelConfig(name_or_path=str(tmp_path)))


def test_dir_without_tokenizer_refused(tmp_path):
    tiny_model(layers=1).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="tokenizer.save_pretrained"):
        load_target(ModelConfig(name_or_path=str(tmp_path)))


def test_hub_id_offline_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # nothing cached there
    with pytest.raises(ModelError) as info:
        load_target(ModelConfig(name_or_path="someorg/not-a-cached-model"))
    msg = str(info.value)
    assert "huggingface-cli download someorg/not-a-cached-model --local-dir DIR" in msg and "pass DIR" in msg


@pytest.mark.parametrize("name, match", [("tiny:foo", "tiny:llama"), ("bundled:other", "only one"),
                                         ("./no/such/dir", "not found")])
def test_unknown_names_refused(name, match):
    with pytest.raises(ModelError, match=match):
        load_target(ModelConfig(name_or_path=name))


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("TLT_CACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_cache_dir(".cache/models") == tmp_path / ".cache/models"
    assert resolve_cache_dir("/abs/models") == resolve_cache_dir("/abs/models").absolute()
    monkeypatch.setenv("TLT_CACHE_DIR", "shared")
    assert resolve_cache_dir(".cache/models") == tmp_path / "shared"


def test_incomplete_conversion_never_used(monkeypatch, tmp_path):
    """A conversion that dies half-way leaves no folder behind that a later run would pick up."""
    import tlt.models as m

    def broken(dest):
        dest.mkdir(parents=True, exist_ok=True)  # staged_dir hands over an empty folder
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.delenv("TLT_CACHE_DIR", raising=False)
    monkeypatch.setattr(m, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        bundled_smollm2_dir(tmp_path)
    assert not (tmp_path / "smollm2-135m-instruct").exists()
    assert not list(tmp_path.glob(".smollm2-135m-instruct.tmp-*"))


@pytest.mark.slow
def test_bundled_smollm2_converts_and_answers(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    start = time.perf_counter()
    folder = bundled_smollm2_dir(cache)
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    model, tok = load_target(ModelConfig(cache_dir=str(cache)))
    load_s = time.perf_counter() - start
    print(f"\nconversion {convert_s:.1f} s, later load {load_s:.2f} s ({folder})")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    msgs = [{"role": "user", "content": "What is 2+3? Reply with only the final number."}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=16, do_sample=False, eos_token_id=eos_token_ids(tok, model))
    reply = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in reply), reply
