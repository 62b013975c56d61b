"""The run's model folder: policy/ (save_pretrained) + drafter/ (EAGLE-3) + README.md, written
atomically with readable files; its figures are measured on the folder reloaded as a server loads
it; refusals leave nothing behind."""
from __future__ import annotations

import json
import stat

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tlt.config import build_config
from tlt.drafter.model import build_drafter
from tlt.drafter.eagle3 import ExportError, export_eagle3
from tlt.model_folder import check_pair, load_model_folder, load_policy_weights, write_model_folder
from tlt.models import eos_token_ids, load_target, tiny_model, tiny_tokenizer
from tlt.rollout.torch_engine.engine import RolloutEngine
from tlt.stages.export import base_figures, measure_folder, write_and_measure
from tlt.rollout.acceptance import heldout_accept

PROMPTS = ["What is 2 + 3?", "What is 4 * 2?", "What is 9 - 5?", "Name a color."]


def _cfg(*extra):
    return build_config({}, ["model.name_or_path=tiny:llama", "model.tiny_layers=6", "drafter.draft_vocab_size=64",
                             "drafter.warmstart_eval_prompts=4", "drafter.eval_max_new_tokens=12",
                             "rollout.temperature=0.7", *extra])


@pytest.fixture(scope="module")
def run_parts(one_thread):
    cfg = _cfg("export.dtype=float32")
    model, tok = load_target(cfg.model)
    return cfg, model, tok, _trained_drafter(cfg, model, tok)


def _trained_drafter(cfg, model, tok):
    """A drafter fit to the policy's own greedy continuations of PROMPTS: it accepts (accept length
    well above 1), so the figures below compare real numbers, not 1.0 with 1.0."""
    from tlt.build import encoder
    from tlt.drafter.train import DrafterTrainer, collect_samples, count_tokens, fit

    dcfg = cfg.drafter.model_copy(update={"lr": 3e-3, "loss_token_weight": 1.0, "ttt_steps": 3})
    torch.manual_seed(0)
    drafter = build_drafter(model, dcfg)
    prompts = encoder(tok, cfg)(PROMPTS)
    engine = RolloutEngine(model, cfg.rollout.model_copy(update={"dtype": "float32"}), [], tok.pad_token_id)
    seqs = [p + list(r) for p, r in zip(prompts, engine.generate(prompts, max_new_tokens=24, temperature=0.0,
                                                                     spec=False).response_ids)]
    samples = collect_samples(model, seqs, [len(p) for p in prompts], drafter.aux_layer_ids)
    drafter.set_vocab(count_tokens(samples, model.config.vocab_size))
    fit(DrafterTrainer(drafter, dcfg, model.lm_head.weight), samples, epochs=40, batch_tokens=512)
    return drafter.eval()


def _write(cfg, model, tok, drafter, out, **kw):
    figures = base_figures(cfg, "run123", 2, 0.25, len(PROMPTS))
    return write_and_measure(cfg, out, model, tok, eos_token_ids(tok, model), drafter, figures, PROMPTS, **kw)


def test_folder_layout_files_and_readme(run_parts, tmp_path):
    cfg, model, tok, drafter = run_parts
    cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"dtype": "bfloat16"})})
    path, figures = _write(cfg, model, tok, drafter, tmp_path / "out")
    assert path == (tmp_path / "out").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left
    assert {p.name for p in path.iterdir()} == {"policy", "drafter", "README.md", "tlt-model.json"}
    weights = load_file(str(path / "policy" / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert set(weights) == set(model.state_dict())
    config = json.loads((path / "policy" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 10000.0
    assert AutoTokenizer.from_pretrained(str(path / "policy")).chat_template == tok.chat_template
    gen = json.loads((path / "policy" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == eos_token_ids(tok, model)[0]
    assert json.loads((path / "drafter" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for p in path.rglob("*"):  # a server often runs as another user (safetensors writes 0600)
        assert stat.S_IMODE(p.stat().st_mode) == (0o755 if p.is_dir() else 0o644), p
    readme = (path / "README.md").read_text()
    assert f"vllm serve {path / 'policy'} --speculative-config" in readme
    assert f'"model":"{path / "drafter"}","num_speculative_tokens":4' in readme
    assert f"--speculative-draft-model-path {path / 'drafter'}" in readme and "<" not in readme
    assert f"| accept length, greedy | {figures['accept_len']} |" in readme
    saved = json.loads((path / "tlt-model.json").read_text())
    assert saved == figures and saved["precision"] == "bfloat16" and saved["run_id"] == "run123"
    assert saved["heldout_accuracy"] == 0.25 and saved["format"] == "tlt-model" and saved["tlt_version"]


def test_figures_are_the_reloaded_folders_accept_lengths(run_parts, tmp_path):
    """fp32 export: the folder's measured figures equal tlt's accept-length code on the in-memory
    policy and drafter (so the measurement reads what was written, and reads it right)."""
    cfg, model, tok, drafter = run_parts
    path, figures = _write(cfg, model, tok, drafter, tmp_path / "out")
    engine = RolloutEngine(model, cfg.rollout.model_copy(update={"dtype": "float32"}), eos_token_ids(tok, model),
                           tok.pad_token_id, drafter=drafter)
    from tlt.build import encoder

    ids = encoder(tok, cfg)(PROMPTS)
    assert figures["accept_len"] == round(heldout_accept(engine, ids, cfg, 0.0).accept_len, 4)
    assert figures["accept_len_sampled"] == round(heldout_accept(engine, ids, cfg, 0.7).accept_len, 4)
    assert measure_folder(cfg, path, PROMPTS) == {k: figures[k] for k in ("accept_len", "accept_len_sampled")}
    assert figures["accept_len"] > 1.5  # a drafter that accepts: the equalities above compare real figures
    policy, _, reloaded = load_model_folder(path)
    x = torch.randint(0, 512, (1, 7))
    torch.testing.assert_close(policy(x).logits, model(x).logits, atol=0, rtol=0)
    torch.testing.assert_close(reloaded.lm_head.weight, drafter.lm_head.weight, atol=0, rtol=0)


def test_non_empty_out_refused_and_left_alone(run_parts, tmp_path):
    cfg, model, tok, drafter = run_parts
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="exists and is not empty.*--force"):
        _write(cfg, model, tok, drafter, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    _write(cfg, model, tok, drafter, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "policy").is_dir()


def test_a_failure_midway_leaves_nothing(run_parts, tmp_path):
    cfg, model, tok, drafter = run_parts

    def boom(tmp):
        raise RuntimeError("measurement failed")

    with pytest.raises(RuntimeError, match="measurement failed"):
        write_model_folder(tmp_path / "out", model, tok, [2], drafter, torch.float32, {}, measure=boom)
    assert list(tmp_path.iterdir()) == []


def test_policy_and_drafter_that_disagree_are_refused(run_parts, tmp_path):
    cfg, model, tok, drafter = run_parts
    path, _ = _write(cfg, model, tok, drafter, tmp_path / "out")
    other = tiny_model("llama", layers=6, hidden=192, vocab=512)
    export_eagle3(build_drafter(other, cfg.drafter), other.config, path / "drafter", force=True)
    with pytest.raises(ExportError, match="drafter was made for hidden size 192 / vocabulary 512, the policy has 128"):
        check_pair(path)
    with pytest.raises(ExportError, match="hidden size 192"):
        load_model_folder(path)


def test_tied_embeddings_written_once_and_reloaded(tmp_path):
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    drafter = build_drafter(model, _cfg().drafter.model_copy(update={"draft_vocab_size": 0}))
    path, _ = write_model_folder(tmp_path / "out", model, tiny_tokenizer(), [2], drafter, torch.float32, {})
    weights = load_file(str(path / "policy" / "model.safetensors"))
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    torch.manual_seed(1)
    fresh = LlamaForCausalLM(cfg).eval()
    load_policy_weights(fresh, path / "policy")
    x = torch.randint(0, 300, (1, 5))
    torch.testing.assert_close(fresh(x).logits, model(x).logits, atol=0, rtol=0)
    assert AutoConfig.from_pretrained(str(path / "policy")).tie_word_embeddings


def test_policy_of_another_architecture_is_refused(run_parts, tmp_path):
    cfg, model, tok, drafter = run_parts
    path, _ = _write(cfg, model, tok, drafter, tmp_path / "out", what="policy")
    assert {p.name for p in path.iterdir()} == {"policy", "README.md", "tlt-model.json"}
    with pytest.raises(ExportError, match="does not fit model.name_or_path's architecture"):
        load_policy_weights(tiny_model("llama", layers=6, hidden=192, vocab=512), path / "policy")
