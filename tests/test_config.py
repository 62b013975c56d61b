import subprocess
import sys
from pathlib import Path

import pytest

from tlt.config import ConfigError, RunConfig, build_config, flatten, load_config, reference_markdown

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("recipe", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.name)
def test_recipes_validate(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, RunConfig)


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"unknown key 'rl.stpes': did you mean 'rl.steps'\?"):
        build_config({"rl": {"stpes": 3}})


def test_unknown_section_named():
    with pytest.raises(ConfigError, match=r"unknown key 'rolout': did you mean 'rollout'\?"):
        build_config({"rolout": {}})


@pytest.mark.parametrize("variant", ["eagle3", "eagle1"])
def test_removed_drafter_variant_is_named_with_the_fix(tmp_path, variant):
    old = tmp_path / "old.yaml"  # a recipe or run folder written before the key went
    old.write_text(f"drafter:\n  variant: {variant}\n  lr: 0.001\n")
    with pytest.raises(ConfigError, match=r"key 'drafter.variant' was removed: the drafter is always EAGLE-3.*delete"):
        load_config(old)


def test_wrong_type_and_range_name_the_key():
    with pytest.raises(ConfigError, match=r"'rl.steps'"):
        build_config({"rl": {"steps": "many"}})
    with pytest.raises(ConfigError, match=r"'rollout.temperature'"):
        build_config(overrides=["rollout.temperature=-1"])


def test_cross_field_check():
    with pytest.raises(ConfigError, match="clip_high"):
        build_config({"rl": {"clip_low": 0.3, "clip_high": 0.2}})


@pytest.mark.parametrize("sets, match", [
    (["trainer.world_size=2", "cluster.backend=ray"], "set trainer.backend: deepspeed"),
    (["trainer.world_size=2", "trainer.backend=deepspeed"], "set cluster.backend: ray"),
    (["cluster.backend=ray", "rollout.workers=2"], "cluster.rollout_actors; set rollout.workers: 1"),
])
def test_cluster_cross_checks(sets, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=sets)


def test_cluster_defaults_are_local_and_ray_config_loads():
    assert build_config().cluster.backend == "local" and build_config().trainer.world_size == 1
    cfg = load_config(ROOT / "conf" / "smoke.yaml", ["cluster.backend=ray", "trainer.world_size=2",
                                                     "cluster.rollout_actors=2", "trainer.backend=deepspeed"])
    assert (cfg.cluster.rollout_actors, cfg.trainer.world_size, cfg.cluster.address) == (2, 2, "")


def test_overrides_parse_yaml_scalars():
    cfg = build_config(overrides=["rl.steps=3", "rollout.spec=false", "data.path=x.jsonl", "drafter.aux_layer_ids=[1,2,3]"])
    assert cfg.rl.steps == 3 and cfg.rollout.spec is False and cfg.data.path == "x.jsonl"
    assert cfg.drafter.aux_layer_ids == [1, 2, 3]
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        build_config(overrides=["rl.steps"])


def test_flatten_has_every_leaf():
    flat = flatten(RunConfig())
    assert flat["rl.steps"] == str(RunConfig().rl.steps)
    assert "rollout.strategy.depth" in flat


def test_docs_config_reference_in_sync():
    """docs/configuration.md holds the generated reference; regenerate with
    `tlt config reference --write docs/configuration.md`."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert reference_markdown() in page, ("docs/configuration.md config reference is stale: run "
                                          "`tlt config reference --write docs/configuration.md`")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tlt.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_config_check_exit_codes(tmp_path):
    assert _cli("config", "check", "conf/smoke.yaml").returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  tempreature: 1.0\n")
    r = _cli("config", "check", str(bad))
    assert r.returncode == 2
    assert "rollout.tempreature" in r.stderr and "rollout.temperature" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("config", "check", "conf/smoke.yaml", "--set", "rl.steps=-1")
    assert r.returncode == 2 and "rl.steps" in r.stderr


def test_cli_config_check_validates_every_recipe():
    """`tlt config check conf/*.yaml`: each recipe, the GPU ones included, passes without a model or a GPU."""
    recipes = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "conf").glob("*.yaml"))
    r = _cli("config", "check", *recipes)
    assert r.returncode == 0, r.stderr
    assert [line.split()[1] for line in r.stdout.splitlines() if line.startswith("ok:")] == recipes
    assert "conf/gpu-8x.yaml is valid" in r.stdout and "8 vllm rollout actor(s), 8 trainer rank(s), colocated, 8 GPU(s)" in r.stdout
    assert "16 GPU(s)" in r.stdout  # gpu-2node


def test_gpu_recipes_train_fp32_masters_with_vllm_on_cuda_graphs():
    for name in ("gpu-1x", "gpu-8x", "gpu-2node"):
        cfg = load_config(ROOT / "conf" / f"{name}.yaml")
        assert (cfg.model.dtype, cfg.trainer.precision, cfg.rollout.dtype) == ("float32", "bf16-mixed", "bfloat16")
        v = cfg.rollout.vllm
        assert cfg.rollout.backend == "vllm" and v.enforce_eager is False and v.sleep_mode is True


def test_workers_with_vllm_backend_is_refused():
    with pytest.raises(ConfigError, match="rollout.workers: 1 with rollout.backend: vllm"):
        load_config(ROOT / "conf" / "smoke.yaml", ["rollout.workers=2", "rollout.backend=vllm"])


def test_a_union_value_error_names_the_key_once():
    """rollout.spec_threshold is a number or `auto`: a bad value gets one line naming the key (not pydantic's
    member tags) with both accepted forms."""
    with pytest.raises(ConfigError) as err:
        build_config(overrides=["rollout.spec_threshold=-2"])
    text = str(err.value)
    assert "invalid value for 'rollout.spec_threshold': " in text and "'auto'" in text and "greater than or equal to 0" in text
    assert "constrained-int" not in text and text.count("invalid value") == 1
    assert build_config(overrides=["rollout.spec_threshold=4"]).rollout.spec_threshold == 4
    assert RunConfig().rollout.spec_threshold == "auto"
