"""EAGLE-3 export: exact key set and shapes, vocab maps, config round-trip, reload, refusals."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tlt.config import DrafterConfig
from tlt.drafter.model import build_drafter
from tlt.drafter.eagle3 import ExportError, check_export, expected_shapes, export_eagle3, load_eagle3
from tlt.models import tiny_model

SPEC_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def _drafter(target, vd=64, seed=0):
    d = build_drafter(target, DrafterConfig(draft_vocab_size=vd))
    counts = torch.rand(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    d.set_vocab(counts)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # "trained": differs from the target-initialised rows
    return d.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=6, hidden=128, vocab=512, seed=0)


@pytest.fixture
def exported(target, tmp_path):
    d = _drafter(target)
    return d, export_eagle3(d, target.config, tmp_path / "drafter")


def test_key_set_shapes_and_dtypes(target, exported):
    d, path = exported
    t = load_file(str(path / "model.safetensors"))
    assert set(t) == SPEC_KEYS
    assert t["fc.weight"].shape == (128, 3 * 128)
    assert t["midlayer.self_attn.q_proj.weight"].shape == (128, 256)
    assert t["midlayer.self_attn.k_proj.weight"].shape == (64, 256)
    assert t["lm_head.weight"].shape == (64, 128)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    ids = torch.arange(64) + t["d2t"]
    assert bool((ids[1:] > ids[:-1]).all()) and int(ids[-1]) < 512 and int(t["t2d"].sum()) == 64
    assert {k: tuple(v.shape) for k, v in t.items()} == expected_shapes(target.config, 64)
    assert check_export(path, target.config) == []
    assert sorted(p.name for p in path.parent.iterdir()) == ["drafter"]  # no temp dirs left


def test_config_roundtrip(target, exported):
    d, path = exported
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["model_type"] == "llama"
    assert raw["draft_vocab_size"] == 64 and raw["target_hidden_size"] == 128 and raw["vocab_size"] == 512
    assert raw["bias"] is False and raw["tie_word_embeddings"] is False
    assert raw["rope_theta"] == 10000.0 and raw["rope_scaling"] is None
    assert raw["eagle_aux_hidden_state_layer_ids"] == d.aux_layer_ids == [1, 3, 5]
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    cfg = AutoConfig.from_pretrained(str(path))
    assert cfg.num_hidden_layers == 1 and cfg.head_dim == 64 and cfg.num_key_value_heads == 1
    assert cfg.max_position_embeddings == target.config.max_position_embeddings
    assert cfg.rope_parameters["rope_theta"] == 10000.0


def test_reload_gives_identical_logits(target, exported):
    d, path = exported
    d2 = load_eagle3(path, target)
    assert d2.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(0, 512, (2, 9))
    aux = target(ids, output_hidden_states=True).hidden_states
    aux = d.gather_aux(aux, d.aux_layer_ids)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        h1, l1, _ = d(ids, d.fuse(aux), pos)
        h2, l2, _ = d2(ids, d2.fuse(aux), pos)
    torch.testing.assert_close(l1, l2, atol=0, rtol=0)
    assert torch.equal(d2.d2t, d.d2t) and d2.aux_layer_ids == d.aux_layer_ids


def test_mismatched_target_refused(exported):
    _, path = exported
    other = tiny_model("llama", layers=2, hidden=192, vocab=300)
    with pytest.raises(ExportError, match="drafter made for hidden 128 / vocab 512, target has hidden 192"):
        load_eagle3(path, other)


def test_non_empty_dir_refused_without_force(target, exported):
    d, path = exported
    with pytest.raises(ExportError, match="force=True"):
        export_eagle3(d, target.config, path)
    d.fc.weight.data.zero_()
    export_eagle3(d, target.config, path, force=True)
    assert load_file(str(path / "model.safetensors"))["fc.weight"].abs().sum() == 0


def test_check_export_finds_problems(target, exported, tmp_path):
    _, path = exported
    t = load_file(str(path / "model.safetensors"))
    t["model.fc.weight"] = t.pop("fc.weight")
    t["d2t"] = t["d2t"].flip(0)
    save_file(t, str(path / "model.safetensors"))
    problems = " | ".join(check_export(path, target.config))
    assert "missing weights ['fc.weight']" in problems and "model.fc.weight" in problems
    assert "strictly increasing" in problems


def test_qwen2_target_exports_as_llama(tmp_path):
    qwen = tiny_model("qwen2", layers=4, hidden=128, vocab=512)
    d = _drafter(qwen, vd=0)
    path = export_eagle3(d, qwen.config, tmp_path / "q")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 512
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    t = load_file(str(path / "model.safetensors"))
    # full vocabulary: no d2t/t2d (vLLM refuses them when draft_vocab_size == vocab_size)
    assert set(t) == SPEC_KEYS - {"d2t", "t2d"}
    reloaded = load_eagle3(path, qwen)
    assert not reloaded.d2t.any() and bool(reloaded.t2d.all())
    assert check_export(path, qwen.config) == []
    d2 = load_eagle3(path, qwen)
    torch.testing.assert_close(d2.lm_head.weight, d.lm_head.weight)
