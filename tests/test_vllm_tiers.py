"""vLLM backend, per batch-size tier: the spec guard's drafter probe after every load, the guard's
run-time switch-off, and the bandit over draft lengths (tlt.rollout.guard, tlt.rollout.vllm_tiers).
Tiny tied-embedding target as in test_vllm_backend (fp32), one engine for the module:
  - the engine's drafter passes the probe at start and after a reload; an export whose weights were
    scaled or zeroed on disk raises DrafterMismatch, and a correct export afterwards loads and passes;
  - with the tuner on, the K chosen per tier changes vLLM's schedule table between rollouts (no
    rebuild) and greedy outputs stay equal to SD off.
"""
from __future__ import annotations

import pytest
import torch

from test_vllm_backend import EOS, K, VLLM_PY, _prompts, _rollout_cfg, _tied_target

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` (~3 min, 3.5 GB) or run `make test-vllm`"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tlt.config import DrafterConfig
    from tlt.drafter.model import build_drafter
    from tlt.models import tiny_tokenizer
    from tlt.rollout.vllm_backend import VllmRolloutEngine

    target, prompts = _tied_target(), _prompts()
    torch.manual_seed(0)
    drafter = build_drafter(target, DrafterConfig(draft_vocab_size=256, ttt_steps=K)).eval()
    engine = VllmRolloutEngine(target, _rollout_cfg().model_copy(update={"tuner": True, "tuner_buckets": [1, 2, 3]}), EOS, 0, drafter=drafter,
                               tokenizer=tiny_tokenizer(), run_dir=tmp_path_factory.mktemp("run"), max_model_len=64,
                               max_num_seqs=16)
    yield target, drafter, engine, prompts
    engine.close()


def _corrupting(real, how: str):
    """export_eagle3 that damages the weights it wrote (as a bad disk or a broken writer would)."""
    from safetensors.torch import load_file, save_file

    def export(drafter, target_config, out_dir, **kw):
        path = real(drafter, target_config, out_dir, **kw)
        tensors = load_file(str(path / "model.safetensors"))
        name = "midlayer.mlp.down_proj.weight"
        tensors[name] = tensors[name] * 0.5 if how == "scaled" else torch.zeros_like(tensors[name])
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    return export


@pytest.mark.parametrize("how", ["scaled", "zeroed"])
def test_probe_catches_a_corrupted_drafter_export(setup, monkeypatch, how):
    from tlt.rollout import vllm_backend
    from tlt.rollout.guard import DrafterMismatch

    _, drafter, engine, _ = setup
    assert engine.probe_metrics["spec/probe_error"] < 1e-4  # at start: the exported drafter, fp32
    with torch.no_grad():
        drafter.lm_head.weight.add_(0.01)  # a new drafter (a refresh), so that sync sends it
    monkeypatch.setattr(vllm_backend, "export_eagle3", _corrupting(vllm_backend.export_eagle3, how))
    with pytest.raises(DrafterMismatch, match="not the one just exported"):
        engine.sync()
    monkeypatch.undo()
    metrics = engine.sync()  # the change was not taken as sent: a correct export now loads and passes
    assert metrics["rollout/vllm_rebuilds"] == 0 and engine.probe_metrics["spec/probe_error"] < 1e-4
    print(f"probe after a good reload: {engine.probe_metrics}")
