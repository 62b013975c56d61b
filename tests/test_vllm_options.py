"""`rollout.vllm` resolved per platform (tlt/rollout/vllm_engine/vllm_options.py) and the cluster checks that
go with it: fast, no engine. That the options reach vLLM, and that the CPU build's worker refuses
sleep mode with the fix, is tested in tests/test_ray_vllm.py (with the vLLM venv)."""
import pytest

from tlt.config import ConfigError, RunConfig, build_config
from tlt.config.stages import ClusterConfig
from tlt.rollout.vllm_engine.vllm_options import OptionError, llm_kwargs, notes, resolve

DEFAULTS = RunConfig().rollout.vllm.model_dump()


@pytest.mark.parametrize("platform, colocated, eager, sleep", [
    ("cpu", True, True, False),  # no CUDA graphs to capture, no sleep mode in the CPU build
    ("cuda", True, False, True),  # CUDA graphs; the update shares the GPU: sleep around it
    ("cuda", False, False, False),  # split placement: the GPU is the engine's alone
])
def test_auto_resolves_per_platform(platform, colocated, eager, sleep):
    r = resolve(DEFAULTS | {"colocated": colocated}, platform)
    assert (r["enforce_eager"], r["sleep_mode"]) == (eager, sleep)
    kw = llm_kwargs(r, kv_cache_mib=64, platform=platform)
    assert kw["enforce_eager"] is eager and kw.get("enable_sleep_mode", False) is sleep
    if platform == "cpu":  # the CPU build reserves bytes; a GPU a share
        assert kw["kv_cache_memory_bytes"] == 64 * 2**20 and "gpu_memory_utilization" not in kw
        assert kw["enable_chunked_prefill"] is False
    else:
        assert kw["gpu_memory_utilization"] == 0.5 and "kv_cache_memory_bytes" not in kw
    assert f"sleep_mode={sleep}" in notes(r, platform)


def test_explicit_values_win_and_sleep_mode_on_cpu_is_refused_with_the_fix():
    r = resolve(DEFAULTS | {"enforce_eager": False, "sleep_mode": False, "tensor_parallel_size": 4,
                            "gpu_memory_utilization": 0.3, "colocated": True}, "cuda")
    assert llm_kwargs(r, 64, "cuda") == {"enforce_eager": False, "tensor_parallel_size": 4, "gpu_memory_utilization": 0.3}
    assert resolve(DEFAULTS | {"enforce_eager": False}, "cpu")["enforce_eager"] is False  # compiled on CPU if asked
    with pytest.raises(OptionError, match=r"rollout.vllm.sleep_mode: true needs a GPU.*sleep_mode: auto"):
        resolve(DEFAULTS | {"sleep_mode": True, "colocated": True}, "cpu")


def test_ray_with_vllm_is_accepted_and_colocated_bundles_hold_actor_and_rank():
    pytest.importorskip("ray")  # tlt.cluster imports it (the ray extra)
    from tlt.cluster.placement import bundles

    cfg = build_config(overrides=["cluster.backend=ray", "rollout.backend=vllm", "cluster.rollout_actors=2",
                                  "trainer.world_size=2", "trainer.backend=deepspeed"])
    assert cfg.cluster.placement == "split"
    c = ClusterConfig(backend="ray", rollout_actors=2, placement="colocated", rollout_actor_gpus=0.5, trainer_gpus=0.5,
                      rollout_actor_cpus=1, trainer_cpus=2)
    assert bundles(c, 2) == [{"CPU": 3, "GPU": 1.0}] * 2  # rank i on actor i's GPU
    assert bundles(c.model_copy(update={"placement": "split"}), 2) == [{"CPU": 1, "GPU": 0.5}] * 2 + [
        {"CPU": 2, "GPU": 0.5}] * 2


RAY = ["cluster.backend=ray", "rollout.backend=vllm", "trainer.backend=deepspeed"]


@pytest.mark.parametrize("sets, match", [
    (["cluster.placement=colocated", "cluster.rollout_actors=2", "trainer.world_size=4"], "set cluster.rollout_actors: 4"),
    (["cluster.placement=colocated", "rollout.vllm.tensor_parallel_size=2", "cluster.rollout_actor_gpus=2"],
     "set cluster.placement: split, or tensor_parallel_size: 1"),
    (["rollout.vllm.tensor_parallel_size=2", "cluster.rollout_actor_gpus=1"], "set cluster.rollout_actor_gpus: 2"),
    (["rollout.vllm.sleep_mode=true", "trainer.world_size=2", "cluster.rollout_actors=2"],
     "set sleep_mode: auto or cluster.placement: colocated"),
])
def test_placement_cross_checks_name_the_fix(sets, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=RAY + sets)


def test_option_ranges_are_checked():
    with pytest.raises(ConfigError, match="rollout.vllm.gpu_memory_utilization"):
        build_config(overrides=["rollout.vllm.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="rollout.vllm.sleep_mode"):
        build_config(overrides=["rollout.vllm.sleep_mode=sometimes"])
    assert build_config(overrides=["rollout.vllm.enforce_eager=false"]).rollout.vllm.enforce_eager is False

