"""Where the policy trains (`trainer.device`), checked on a CPU-only machine: the setting resolves,
a recipe that says cuda validates statically but a run is refused before anything starts, every
tensor factory in the RL, rollout and drafter code names its device (the class of bug that only a
GPU shows), and what leaves the process is moved to the CPU. tests/test_gpu_train.py runs the
same step on a GPU."""
from __future__ import annotations

import ast
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from cli_runs import cli_env, run_tlt
from tlt.config import ConfigError, RunConfig, load_config
from tlt.device import module_device, resolve_device, to_cpu
from tlt.errors import UserError
from tlt.inputs import check_device
from tlt.models import load_target
from tlt.rl.update import PolicyBatch

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()


# ---- resolution ---------------------------------------------------------------------------------
@pytest.mark.skipif(not NO_CUDA, reason="auto resolves to the GPU on this machine")
def test_auto_is_the_cpu_without_cuda():
    assert resolve_device("auto") == torch.device("cpu")
    assert RunConfig().trainer.device == "auto"


def test_cpu_is_the_cpu():
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_without_cuda_names_the_key_and_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as err:
        resolve_device("cuda")
    msg = str(err.value)
    assert "trainer.device: cuda" in msg and "trainer.device: auto" in msg and "trainer.device: cpu" in msg
    assert resolve_device("auto") == torch.device("cpu")


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="trainer.device"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="trainer.device"):
        load_config(ROOT / "conf" / "smoke.yaml", ["trainer.device=tpu"])


# ---- static config check vs the before-services input check -------------------------------------
def test_a_recipe_saying_cuda_passes_the_static_check():
    cfg = load_config(ROOT / "conf" / "smoke.yaml", ["trainer.device=cuda"])
    assert cfg.trainer.device == "cuda"


def test_input_check_refuses_cuda_without_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(ROOT / "conf" / "smoke.yaml", ["trainer.device=cuda"])
    with pytest.raises(UserError, match="trainer.device: cuda"):
        check_device(cfg)
    check_device(load_config(ROOT / "conf" / "smoke.yaml", ["trainer.device=auto"]))


def test_input_check_refuses_deepspeed_on_cpu_where_it_would_take_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cfg = load_config(ROOT / "conf" / "smoke.yaml", ["trainer.device=cpu", "trainer.backend=deepspeed"])
    with pytest.raises(UserError, match="DS_ACCELERATOR=cpu"):
        check_device(cfg)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    check_device(cfg)
    check_device(load_config(ROOT / "conf" / "smoke.yaml", ["trainer.device=cpu"]))  # torch: its own device


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: cuda is a valid setting here")
def test_run_with_cuda_on_a_cpu_machine_exits_2_before_anything_starts(tmp_path):
    proc = run_tlt(["run", "conf/smoke.yaml", "--set", f"trainer.checkpoint_dir={tmp_path / 'runs'}",
                    "--set", "trainer.device=cuda"], cli_env(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert "trainer.device: cuda" in last and "trainer.device: auto" in last, last
    assert not (tmp_path / "runs").exists() and not (tmp_path / "prefect").exists()


@pytest.mark.parametrize("sets,words", [
    (["trainer.device=cuda", "cluster.trainer_gpus=0"], ["trainer.device: cuda", "cluster.trainer_gpus"]),
    (["trainer.device=cpu", "cluster.trainer_gpus=1"], ["trainer.device: cpu", "cluster.trainer_gpus: 0"]),
])
def test_ray_ranks_device_and_gpus_must_agree(sets, words):
    base = ["cluster.backend=ray", "trainer.backend=deepspeed", "trainer.world_size=2", "cluster.rollout_actors=2"]
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "conf" / "smoke.yaml", [*base, *sets])
    for w in words:
        assert w in str(err.value)
    load_config(ROOT / "conf" / "smoke.yaml", [*base, "trainer.device=auto", sets[1]])  # auto fits either


def test_gpu_recipes_validate_here():
    for name in ("gpu-1x", "gpu-8x", "gpu-2node"):
        cfg = load_config(ROOT / "conf" / f"{name}.yaml")
        assert cfg.trainer.device in ("auto", "cuda"), name


# ---- placement ----------------------------------------------------------------------------------
def test_load_target_places_the_policy_and_the_drafter_follows():
    from tlt.config import DrafterConfig, ModelConfig
    from tlt.drafter.model import build_drafter

    model, _ = load_target(ModelConfig(name_or_path="tiny:llama", tiny_layers=2), torch.device("cpu"))
    assert module_device(model).type == "cpu"
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=0))
    assert {p.device for p in drafter.parameters()} == {module_device(model)}
    assert module_device(torch.nn.Module()) == torch.device("cpu")  # no parameters: the CPU


def test_policy_batch_to_keeps_none_and_moves_every_tensor():
    ids = torch.ones(2, 3, dtype=torch.long)
    batch = PolicyBatch(ids, ids, ids.bool(), None, torch.zeros(2), position_ids=ids)
    moved = batch.to("meta")  # a device that exists everywhere: every tensor must report it
    assert moved.old_logp is None and moved.ref_logp is None
    assert {getattr(moved, f).device.type for f in ("input_ids", "attention_mask", "response_mask", "advantages",
                                                     "position_ids")} == {"meta"}


def test_to_cpu_walks_containers_and_copies_nothing_already_there():
    w = torch.randn(3, requires_grad=True)
    state = OrderedDict(a=w, b={"c": [w, (w, 1)], "d": "text"}, e=None)
    out = to_cpu(state)
    assert type(out) is OrderedDict and list(out) == ["a", "b", "e"]
    assert out["b"]["d"] == "text" and out["e"] is None and out["b"]["c"][1][1] == 1
    for t in (out["a"], out["b"]["c"][0], out["b"]["c"][1][0]):
        assert t.device.type == "cpu" and not t.requires_grad and t.data_ptr() == w.data_ptr()


# ---- every tensor factory names its device ------------------------------------------------------
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "rand", "randn", "randint", "randperm", "eye",
             "linspace", "logspace", "as_tensor", "empty_strided", "Generator"}
SCANNED = ("tlt/rl", "tlt/rollout", "tlt/drafter")
HOST = "host-side buffer, filled on the CPU and moved (or read) where it is used"
# (file, function): why its factories may take the default (CPU) device. A new call elsewhere must
# pass device= (or be a *_like / new_* call); an entry whose function no longer has one must go.
ALLOWED = {
    ("tlt/rollout/torch_engine/calibrate.py", "Calibrator.__init__"): "acceptance statistics kept on the CPU (inputs .cpu()'d)",
    ("tlt/rollout/torch_engine/calibrate.py", "Calibrator.update"): "acceptance statistics kept on the CPU (inputs .cpu()'d)",
    ("tlt/rollout/torch_engine/engine.py", "RolloutEngine._prefill"): "a prompt row copied into a device tensor by slice assignment",
    ("tlt/rollout/torch_engine/engine.py", "Capture.add_prompts"): "captured features gathered on the CPU (.cpu() per step)",
    ("tlt/rollout/guard.py", "probe_inputs"): "the probe is saved to a file for vLLM; probe_logits moves it",
    ("tlt/rollout/torch_engine/draft.py", "tree_from_nodes"): HOST + " (moved with .to(device) at the end)",
    ("tlt/rollout/vllm_engine/process.py", "kv_cache_budget_mib"): "an empty tensor read for its element size only",
    ("tlt/drafter/accept_eval.py", "_pad"): HOST + " (moved with .to(dev) at the end)",
    ("tlt/rollout/vllm_engine/vllm_ext.py", "TltWorkerExtension.tlt_expand_probe"): "a probe of vLLM's CPU sampler fallback "
                                                                         "(run on the CPU platform only)",
    ("tlt/drafter/buffer.py", "DraftBuffer.batches"): "a shuffle seed drawn from a CPU generator",
    ("tlt/drafter/buffer.py", "DraftBuffer.token_counts"): "counts over the CPU buffer",
    ("tlt/drafter/eagle3.py", "_check_vocab"): "checks an export's tensors, loaded from safetensors on the CPU",
    ("tlt/drafter/model.py", "RMSNorm.__init__"): "module construction: builders move the module (.to(device))",
    ("tlt/drafter/model.py", "Eagle3Drafter.__init__"): "module construction: builders move the module (.to(device))",
    ("tlt/drafter/model.py", "Eagle3Drafter._rope_frequencies"): "module construction, on the CPU also under meta",
    ("tlt/drafter/online.py", "OnlineRefresher.__init__"): "a CPU generator that draws shuffle seeds",
    ("tlt/drafter/train.py", "_collate"): HOST + " (compute_loss moves the batch to the drafter's device)",
    ("tlt/drafter/train.py", "collect_samples"): HOST + " (ids moved with .to(dev); samples live on the CPU)",
    ("tlt/drafter/train.py", "count_tokens"): "counts over CPU samples",
}


def unplaced_factories(source: str) -> list[tuple[str, str, int]]:
    """(enclosing Class.function, factory, line) of every `torch.<factory>(...)` call without device=."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            f = getattr(child, "func", None)
            if (isinstance(child, ast.Call) and isinstance(f, ast.Attribute) and f.attr in FACTORIES
                    and isinstance(f.value, ast.Name) and f.value.id == "torch"
                    and not any(k.arg == "device" for k in child.keywords)):
                found.append((".".join(scope) or "<module>", f.attr, child.lineno))
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def _violations() -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for scope, name, line in unplaced_factories(path.read_text()):
                out.setdefault((rel, scope), []).append(f"torch.{name} at line {line}")
    return out


def test_every_tensor_factory_names_its_device():
    bad = {k: v for k, v in _violations().items() if k not in ALLOWED}
    assert not bad, ("tensors created without device= land on the CPU and fail (or silently run there) once the "
                     f"model is on a GPU: pass device=<a tensor>.device, use *_like, or allow-list with a reason: {bad}")


def test_the_allow_list_has_no_stale_entries():
    stale = set(ALLOWED) - set(_violations())
    assert not stale, f"these functions create no device-less tensor any more; drop them from ALLOWED: {stale}"


def test_the_scan_catches_a_planted_violation():
    src = ("import torch\n"
           "class Engine:\n"
           "    def step(self, x):\n"
           "        a = torch.zeros(3, dtype=torch.long)\n"          # planted: lands on the CPU
           "        b = torch.arange(4, device=x.device)\n"
           "        c = torch.zeros_like(x)\n"
           "        d = x.new_zeros(2)\n"
           "        return torch.tensor([1], device='cpu'), torch.Generator()\n")  # the generator is planted too
    assert unplaced_factories(src) == [("Engine.step", "zeros", 4), ("Engine.step", "Generator", 8)]
