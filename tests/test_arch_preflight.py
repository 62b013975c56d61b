"""Architecture-specific reading (tlt.arch) and the refusals it drives: an architecture outside the matrix,
a drafter or export that cannot be built, vLLM for a target it does not serve with EAGLE-3 — exit 2
before Prefect or MLflow start, no run left behind, and a deterministic failure is never retried."""
from __future__ import annotations

import sqlite3

import pytest
import torch

from cli_runs import ROOT, cli_env, run_tlt
from tlt import arch, preflight
from tlt.config import DrafterConfig, load_config
from tlt.drafter.model import Eagle3Drafter
from tlt.errors import UserError, deterministic
from tlt.models import tiny_config, tiny_model, tiny_tokenizer
from tlt.versions import write_weights


def _refused(proc, *words: str) -> str:
    out = proc.stdout
    assert proc.returncode == 2, f"rc {proc.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out and "attempt to run again" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    for w in words:
        assert w in last, (w, last)
    return last


def _nothing_started(tmp) -> None:
    db = tmp / "mlflow.db"
    if db.exists():
        with sqlite3.connect(db) as con:
            assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
    assert not (tmp / "runs").exists() and not (tmp / "prefect").exists()


def test_gemma3_rope_is_read_per_layer_type():
    cfg = tiny_config("gemma3")
    assert set(arch.rope_parameters(cfg)) == {"full_attention", "sliding_attention"}
    assert arch.drafter_rope(cfg) == {"rope_type": "default", "rope_theta": 1_000_000.0}  # the global layers'
    d = Eagle3Drafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size), 64)
    hd = cfg.head_dim
    want = 1.0 / (1_000_000.0 ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    torch.testing.assert_close(d._inv_freq[torch.device("cpu")], want)


def test_partial_rotary_leaves_the_other_channels_alone():
    """Phi-4-mini-style partial RoPE: 3/4 of each head rotates, the last quarter passes through."""
    cfg = tiny_config("phi3")
    assert arch.drafter_rope(cfg)["partial_rotary_factor"] == 0.75
    d = Eagle3Drafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size), 64)
    att = d.midlayer.self_attn
    assert att.rotary_dim == 48 and d._inv_freq[torch.device("cpu")].numel() == 24
    cos, sin = d._rope(torch.tensor([[5]]))
    x = torch.randn(1, 1, 1, att.head_dim)
    from tlt.drafter.model import rotary

    y = rotary(x, cos.unsqueeze(1), sin.unsqueeze(1), att.rotary_dim)
    assert torch.equal(y[..., 48:], x[..., 48:]) and not torch.allclose(y[..., :48], x[..., :48])


@pytest.mark.parametrize("name", ["gemma3", "granite"])
def test_drafter_is_blind_to_the_targets_embedding_scale(name):
    """The drafter reads the raw embedding rows, vLLM's shared embedding does too, and the target scales
    them (Gemma by sqrt(hidden), Granite by embedding_multiplier); input_layernorm normalises the scale
    away, so the drafter's output does not depend on it."""
    model = tiny_model(name)
    emb = model.get_input_embeddings()
    ids = torch.randint(3, 512, (1, 5))
    scale = (emb(ids) / torch.nn.functional.embedding(ids, emb.weight)).flatten()[0].item()
    if name == "granite":  # Granite multiplies after the embedding module
        scale = model.config.embedding_multiplier
    assert scale > 5  # the target does scale
    d = Eagle3Drafter(model.config, emb.weight, 64)
    scaled = Eagle3Drafter(model.config, emb.weight * scale, 64)
    write_weights(scaled, d.state_dict())
    hid, pos = torch.randn(1, 5, model.config.hidden_size), torch.arange(5)[None]
    with torch.no_grad():
        torch.testing.assert_close(d(ids, hid, pos)[1], scaled(ids, hid, pos)[1], atol=1e-4, rtol=1e-4)


def test_unknown_architecture_refused_with_the_matrix():
    from transformers import GPT2Config

    with pytest.raises(arch.ArchError, match="gpt2.*Gemma 3 \\(text\\)"):
        arch.arch_of(GPT2Config())
    from transformers import Gemma3Config

    with pytest.raises(arch.ArchError, match="multimodal Gemma 3.*Gemma3ForCausalLM"):
        arch.arch_of(Gemma3Config())


def test_drafter_plan_catches_what_the_export_would_refuse_at_the_end(monkeypatch):
    cfg = tiny_config("phi3")
    preflight.check_drafter_plan(cfg, DrafterConfig(draft_vocab_size=64))
    with pytest.raises(arch.ArchError, match="aux_layer_ids"):
        preflight.check_drafter_plan(cfg, DrafterConfig(draft_vocab_size=64, aux_layer_ids=[1, 2, 9]))
    import tlt.drafter.eagle3 as export

    # the bug this preflight would have caught: an export that drops the partial rotary factor
    monkeypatch.setattr(export, "rope_keys", lambda c: ({"rope_theta": 10000.0, "rope_scaling": None}, {}))
    with pytest.raises(arch.ArchError, match="RoPE .*differs"):
        preflight.check_drafter_plan(cfg, DrafterConfig(draft_vocab_size=64))


def test_vllm_support_is_listed_with_reasons():
    for a in arch.MATRIX.values():
        reason = arch.vllm_reason(tiny_config(a.tiny))
        assert reason is None or "vLLM" in reason
    with pytest.raises(arch.ArchError, match="Gemma 3.*rollout.backend: torch"):
        arch.require_vllm_eagle3(tiny_config("gemma3"), "rollout.backend: vllm")
    arch.require_vllm_eagle3(tiny_config("qwen3"), "rollout.backend: vllm")


def test_deterministic_failures_are_not_retried_transient_ones_are():
    from tlt.faults import InjectedFault

    assert deterministic(KeyError("rope_theta")) and deterministic(UserError("bad path"))
    try:
        try:
            raise UserError("unsupported")
        except UserError as inner:
            raise RuntimeError("stage failed") from inner
    except RuntimeError as wrapped:
        assert deterministic(wrapped)
    assert not deterministic(ConnectionError("MLflow down")) and not deterministic(InjectedFault("killed worker"))
    assert not deterministic(torch.OutOfMemoryError("OOM"))
    from tasks import stages  # the flow's abort path: a deterministic failure cancels the flow run's retry

    assert stages._final(KeyError("rope_theta")) and not stages._final(InjectedFault("killed worker"))


def _unsupported_folder(tmp):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=1, vocab_size=512)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_run_with_unsupported_architecture_exits_2_before_any_service(tmp_path):
    folder = _unsupported_folder(tmp_path)
    proc = run_tlt(["run", "conf/smoke.yaml", "--set", f"model.name_or_path={folder}", "--set",
                    f"trainer.checkpoint_dir={tmp_path / 'runs'}"], cli_env(tmp_path), timeout=180)
    _refused(proc, "'gpt2'", "Llama", "docs/getting-started.md")
    _nothing_started(tmp_path)


def test_vllm_rollout_and_export_refused_for_a_target_vllm_does_not_serve(tmp_path):
    proc = run_tlt(["run", "conf/smoke.yaml", "--set", "model.name_or_path=tiny:gemma3", "--set",
                    "rollout.backend=vllm", "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}"],
                   cli_env(tmp_path), timeout=180)
    _refused(proc, "rollout.backend: vllm", "Gemma 3", "gemma3_text")
    _nothing_started(tmp_path)
    from tlt.checkpoint import save_checkpoint
    from tlt.config import dump_yaml

    run = tmp_path / "ckpt" / "run1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_yaml(load_config(ROOT / "conf" / "smoke.yaml",
                                                           ["model.name_or_path=tiny:gemma3"])))
    step = save_checkpoint(run / "checkpoints", 1, {"policy": {"w": torch.zeros(1)}}, {})
    proc = run_tlt(["export", "--checkpoint", str(step), "--out", str(tmp_path / "out")], cli_env(tmp_path),
                   timeout=180)
    _refused(proc, "tlt export", "Gemma 3")
    assert not (tmp_path / "out").exists()


def test_real_gemma3_and_phi4_mini_configs_pass_the_preflight():
    """The configs of Gemma-3-270M (262k vocabulary, 5 local : 1 global layers, two RoPE bases) and
    Phi-4-mini (longrope, partial rotary 0.75, tied head), without weights: drafter and export plan check out."""
    from transformers import Gemma3TextConfig, Phi3Config

    gemma = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                             query_pre_attn_scalar=256, max_position_embeddings=32768)
    phi = Phi3Config(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                     num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
                     original_max_position_embeddings=4096, partial_rotary_factor=0.75, tie_word_embeddings=True,
                     rope_scaling={"type": "longrope", "long_factor": [1.5] * 48, "short_factor": [1.0] * 48})
    for config in (gemma, phi):
        preflight.check_drafter_plan(config, DrafterConfig(draft_vocab_size=8192))
    assert arch.drafter_rope(gemma)["rope_theta"] == gemma.rope_parameters["full_attention"]["rope_theta"]
    assert arch.drafter_rope(phi)["rope_type"] == "longrope"


def test_large_vocabulary_maps_and_export(tmp_path):
    """A 262k vocabulary (Gemma 3) reduced to 2048 draft ids: the maps pick the most frequent ids, the
    export passes its checks and reloads."""
    from tlt.drafter.eagle3 import check_export, export_eagle3

    cfg = tiny_config("gemma3", vocab=262144, hidden=64)
    drafter = Eagle3Drafter(cfg, torch.randn(262144, 64) * 0.02, 2048)
    counts = torch.zeros(262144, dtype=torch.long)
    frequent = torch.randperm(262144, generator=torch.Generator().manual_seed(0))[:2048]
    counts[frequent] = torch.arange(1, 2049)
    drafter.set_vocab(counts)
    assert torch.equal(drafter.draft_to_target_ids(), frequent.sort().values)
    out = export_eagle3(drafter, cfg, tmp_path / "eagle3")
    assert check_export(out, cfg) == []


def test_getting_started_lists_the_matrix_as_tlt_reads_it():
    page = (ROOT / "docs" / "getting-started.md").read_text().split("## Supported architectures", 1)[1]
    rows = {ln.split("`")[1]: ln.split("|") for ln in page.splitlines() if ln.startswith("| ") and "`tiny:" in ln}
    for a in arch.MATRIX.values():
        cells = rows[a.model_type]
        assert cells[3].strip() == "yes" and f"`tiny:{a.tiny}`" in cells[5], cells
        assert cells[4].strip().startswith("no") == (a.vllm is not None), (a.model_type, cells[4])
    assert sorted(rows) == sorted(arch.MATRIX)
