"""The vLLM paths only a GPU takes (`make test-gpu` on a machine with a CUDA device and a vLLM venv
of the CUDA build: TLT_VLLM_PYTHON=/path/bin/python). Skipped elsewhere (tests/conftest.py);
tests/test_ray_vllm.py covers the same paths on the CPU build. Asserts:
  - `rollout.vllm` reaches a CUDA engine: CUDA graphs, sleep mode, the GPU share (read back from
    the built engine's config);
  - sleep (level 1) frees most of the engine's GPU memory; the sync after an update wakes it and
    reloads the new weights: greedy outputs equal a fresh engine's on those weights;
  - two vLLM rollout actors sharing one GPU (half a GPU each in Ray's books) decode on it and
    generate what one engine generates.
"""
from __future__ import annotations

import pytest
import torch

from tlt.config import ClusterConfig, RolloutConfig
from tlt.errors import UserError
from tlt.models import tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
PROMPTS = [[1, 5, 9, 13], [1, 7, 7], [1, 20, 21, 22, 23], [1, 30]]


def _cfg(**vllm) -> RolloutConfig:
    return RolloutConfig(backend="vllm", spec=False, max_new_tokens=16, temperature=0.0,
                         vllm={"gpu_memory_utilization": 0.25, **vllm})


def _engine(model, tmp_path, **vllm):
    from tlt.rollout.vllm_engine.backend import VllmRolloutEngine

    try:
        return VllmRolloutEngine(model, _cfg(**vllm), [2], 0, tokenizer=tiny_tokenizer(), run_dir=tmp_path,
                                 max_model_len=64, max_num_seqs=8)
    except UserError as err:  # the vLLM venv found is the CPU build
        pytest.skip(f"the vLLM interpreter is not a CUDA build ({err}); set TLT_VLLM_PYTHON")


def _update(model) -> None:
    w = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(7)) * 0.5)


def test_sleep_mode_frees_the_gpu_and_wakes_with_the_new_weights(tmp_path):
    model = tiny_model("llama", layers=2, hidden=128, vocab=512, seed=3).eval()
    engine = _engine(model, tmp_path / "a", sleep_mode=True)
    try:
        assert {"platform=cuda", "vllm.enforce_eager=False", "vllm.enable_sleep_mode=True"} <= set(engine.options)
        engine.generate(PROMPTS)
        free, total = torch.cuda.mem_get_info()
        assert "rollout/vllm_sleep_s" in engine.sleep()
        freed = torch.cuda.mem_get_info()[0] - free
        assert freed > 0.15 * total, f"sleep freed {freed / 2**30:.2f} GiB of the engine's 25 %"
        _update(model)
        woke = engine.sync(model)
        assert "rollout/vllm_wake_s" in woke and "rollout/vllm_reload_s" in woke
        after = engine.generate(PROMPTS).response_ids
    finally:
        engine.close()
    fresh = _engine(model, tmp_path / "b", sleep_mode=False)
    try:
        assert fresh.generate(PROMPTS).response_ids == after
    finally:
        fresh.close()


def test_two_vllm_actors_share_one_gpu(tmp_path):
    ray = pytest.importorskip("ray")
    from tlt.cluster import RayPlacement, RayVllmPool

    model = tiny_model("llama", layers=2, hidden=128, vocab=512, seed=3).eval()
    local = _engine(model, tmp_path / "local")
    try:
        ref = local.generate(PROMPTS, group_size=2).response_ids
    finally:
        local.close()
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    placement = RayPlacement.start(ClusterConfig(backend="ray", rollout_actors=2, rollout_actor_gpus=0.5), 1)
    pool = None
    try:
        pool = RayVllmPool(placement, model, _cfg(), [2], 0, tiny_tokenizer(), tmp_path / "actors", max_model_len=64)
        for opts in pool.options():
            assert {"platform=cuda", "vllm.enforce_eager=False"} <= set(opts)
        assert pool.generate(PROMPTS, group_size=2).response_ids == ref
    finally:
        if pool is not None:
            pool.close()
        placement.close()
        ray.shutdown()
