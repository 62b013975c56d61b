"""One RL step of the smoke pipeline with the policy on `trainer.device` (torch rollout engine, the
spot trainer, the torch and the DeepSpeed ZeRO-2 update). The cuda cases carry the `gpu` marker
(`make test-gpu`; skipped without CUDA); the same test on cpu is `slow` and keeps the test itself
honest on a CPU machine. Asserts:
  - the policy and the drafter sit on the device, before and after the step; the step moves the
    policy's weights;
  - what leaves the process is on the CPU: the checkpoint's tensors and its optimizer state (read
    back without map_location), the spot trainer's shared weights; restored into the run on the
    device, the next step runs;
  - fp32: greedy decoding with speculative decoding on every step equals decoding without it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tlt.checkpoint import load_checkpoint
from tlt.config import load_config
from tlt.device import module_device
from tlt.drafter.spot import SpotTrainer
from tlt.rl.resume import restore_run_state, steps_done

ROOT = Path(__file__).resolve().parents[1]
DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_jit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))


def _cpu_only(tree) -> bool:
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "cpu"
    if isinstance(tree, dict):
        return all(_cpu_only(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(_cpu_only(v) for v in tree)
    return True


def _step(tmp_path, device: str, *sets: str):
    """The smoke pipeline on `device` through data, models, warm-start and one RL step; returns the
    pipeline (open: the caller closes it) and the weights before the step."""
    from tlt.pipeline import Pipeline

    cfg = load_config(ROOT / "conf" / "smoke.yaml", [f"trainer.checkpoint_dir={tmp_path}", f"trainer.device={device}",
                                                     "rl.steps=1", "rl.lr=1e-2", *sets])
    pipe = Pipeline(cfg)
    pipe.validate_data()
    pipe.prepare()
    want = torch.device(device).type
    assert module_device(pipe.model).type == want and module_device(pipe.drafter).type == want
    pipe.warmstart()
    before = {k: v.detach().to("cpu", copy=True) for k, v in pipe.model.state_dict().items()}
    pipe.rl_step(0)
    assert module_device(pipe.model).type == want and module_device(pipe.drafter).type == want
    return pipe, before


def _moved(pipe, before) -> bool:
    return any(not torch.equal(before[k], v.detach().cpu()) for k, v in pipe.model.state_dict().items())


def _checkpoint_on_cpu(pipe) -> None:
    """The checkpoint holds CPU tensors only; restored into the live run (CPU optimizer state into an
    optimizer, or a ZeRO engine, on the device), the next step runs and keeps the policy there."""
    tensors, _, pts = load_checkpoint(pipe.last_checkpoint)
    assert _cpu_only(tensors)
    for blob in pts.values():  # without map_location: a GPU tensor in it would come back on the GPU
        assert _cpu_only(torch.load(blob, weights_only=True)), blob.name
    device = module_device(pipe.model)
    assert steps_done(restore_run_state(pipe.ctx, pipe.run_dir / "checkpoints")) == 1
    pipe.rl_step(1)
    assert module_device(pipe.model) == device


@pytest.mark.parametrize("device", DEVICES)
def test_rl_step_on_device_fp32_greedy_sd_lossless(tmp_path, device):
    pipe, before = _step(tmp_path, device, "trainer.precision=fp32")
    try:
        assert _moved(pipe, before)
        _checkpoint_on_cpu(pipe)
        spot = pipe.refresher
        assert isinstance(spot, SpotTrainer)  # smoke: the spot trainer, in a process of its own
        assert all(t.device.type == "cpu" for t in (spot._embed, spot._head, *spot.state.values()))  # its copies
        prompts = pipe.prompt_ids(pipe.dataset.heldout["prompt"][:4])
        plain = pipe.generate_greedy(prompts, 16, sd="off")
        spec = pipe.generate_greedy(prompts, 16, sd="always")
        assert spec == plain
    finally:
        pipe.close()


@pytest.mark.parametrize("device", DEVICES)
def test_rl_step_on_device_deepspeed_zero2_bf16_mixed(tmp_path, device):
    pipe, before = _step(tmp_path, device, "trainer.backend=deepspeed", "trainer.zero_stage=2",
                         "trainer.precision=bf16-mixed")
    try:
        assert _moved(pipe, before)
        assert all(p.dtype == torch.float32 for p in pipe.model.parameters())  # fp32 master weights
        _checkpoint_on_cpu(pipe)
    finally:
        if pipe.ctx is not None:
            pipe.ctx.updater.close()
        pipe.close()
