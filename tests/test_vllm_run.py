"""`rollout.backend: vllm` end to end (the engine's own behaviour: test_vllm_backend.py):
  - the pipeline on conf/smoke.yaml with rollout.backend=vllm: warm-start, one RL step (spot
    trainer started by the tail event), evaluation; the updated policy reaches the worker;
  - bench/vllm_rollout.py on the smoke recipe (its keys, greedy identity, 0 rebuilds);
  - a missing vLLM venv is a user error; a worker whose parent died removes its weights folder.
"""
from __future__ import annotations

import pytest

from test_vllm_backend import ROOT, VLLM_PY, _torch_greedy

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY}; build it with "
                       "`bash bench/vllm_venv.sh` (~3 min, 3.5 GB) or run `make test-vllm`"),
]


def test_missing_vllm_python_is_a_user_error(tmp_path):
    from tlt.errors import UserError
    from tlt.rollout.vllm_engine.process import vllm_python

    with pytest.raises(UserError, match="bench/vllm_venv.sh"):
        vllm_python(tmp_path / "nope" / "python")


def test_pipeline_smoke_rl_step_with_vllm(tmp_path):
    from tlt.config import load_config
    from tlt.pipeline import Pipeline
    from tlt.rollout.vllm_engine.backend import VllmRolloutEngine

    # tuner off: the fixed strategy drafts in every tail (the bandit, priced at the tiny drafter's measured
    # acceptance, may rightly start on plain decoding, which this test is not about)
    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp_path}", "rollout.backend=vllm",
                                                      f"model.cache_dir={tmp_path / 'models'}", "rollout.tuner=false"])
    pipe = Pipeline(cfg)
    try:
        pipe.validate_data()
        pipe.prepare()
        assert isinstance(pipe.engine, VllmRolloutEngine)
        pipe.warmstart()
        summary = pipe.rl_step(0)
        m = summary.metrics
        print({k: round(v, 3) for k, v in m.items() if k.startswith(("timing_s", "spec/accept_len", "rollout/"))})
        assert "timing_s/sync" in m and m["rollout/tokens_per_s"] > 0
        # The rollout samples (T = 0.7): SD on wherever the worker's rejection-sampler probe passed.
        assert ("spec/accept_len/mean" in m) == pipe.engine.sampled_sd
        prompts = pipe.prompt_ids(pipe.dataset.heldout["prompt"])
        # The policy changed in the step (lr 1e-4) and generate_greedy decodes through vLLM.
        assert pipe.generate_greedy(prompts, 8) == [
            [t for t in r if t not in pipe.eos_ids] for r in _torch_greedy(pipe.model, prompts, 8, pipe.eos_ids).response_ids]
        ev = pipe.evaluate(1)  # every held-out prompt decoded through vLLM, scored, and counted once
        assert ev.n == len(ev.records) == len(prompts)
        assert ev.accuracy == sum(r["reward"] >= 1.0 for r in ev.records) / ev.n
    finally:
        pipe.close()


def test_bench_vllm_rollout_end_to_end(tmp_path):
    """bench/vllm_rollout.py on the smoke recipe (tiny target, drafter fit for 2 epochs): every
    key it promises, greedy identity, drafts only in the tail, none with SD off, 0 rebuilds."""
    import json

    from bench_scripts import load_bench

    out = load_bench("vllm_rollout").main([str(ROOT / "conf" / "smoke.yaml"), "--json", str(tmp_path / "out.json"),
                                           "--reps", "1", "--fit-epochs", "2", "--fit-prompts", "4",
                                           "--set", "rollout.spec_threshold=2"])
    assert json.loads((tmp_path / "out.json").read_text()) == out
    keys = {"greedy_identical", "tail_only_drafts", "drafts_static", "drafts_tail", "sync_s", "drafter_reload_s",
            "rebuilds", "rollout_s_vllm_plain", "rollout_s_vllm_tail", "rollout_s_vllm_always",
            "rollout_s_torch_plain", "rollout_s_torch_tail", "rollout_s_vllm_static", "rollout_s_torch_always",
            "rollout_s_torch_static", "speedup_vllm_vs_always", "speedup_vllm_vs_static", "speedup_torch_vs_always",
            "speedup_torch_vs_static", "static_table_vllm", "static_table_torch", "rollout_s_vllm_k0",
            "rollout_s_vllm_plain_engine", "k0_tax"}
    assert keys <= set(out), keys - set(out)
    assert out["greedy_identical"] and out["tail_only_drafts"] and out["rebuilds"] == 0
    assert out["drafts_plain"] == 0 and out["drafts_static"] > 0 and out["drafts_static"] >= out["drafts_tail"]
    assert out["sync_s"] > 0 and out["drafter_reload_s"] > 0


def test_worker_removes_its_weights_folder_when_the_parent_is_gone(tmp_path):
    """A parent killed without cleanup (a Ray actor killed mid-rollout) closes the worker's stdin:
    the worker ends and removes the weights folder it was given, so /dev/shm does not fill up."""
    import subprocess

    from tlt.rollout.vllm_engine.process import WORKER

    work = tmp_path / "tlt-vllm-test"
    (work / "policy-00001").mkdir(parents=True)
    (work / "policy-00001" / "model.safetensors").write_bytes(b"\0" * 1024)
    proc = subprocess.Popen([str(VLLM_PY), str(WORKER), str(work)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc.stdin.close()  # what the worker sees when its parent dies
    assert proc.wait(timeout=300) == 0
    assert not work.exists()
