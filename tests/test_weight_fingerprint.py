"""The vLLM backend re-sends the policy when its weights change; the change is found from a
fingerprint of the weights. DeepSpeed ZeRO-1/2 write updated weights through flat buffers, which
leaves torch's version counters unchanged, so the fingerprint must look at the content."""
import pytest
import torch
from test_fused_update import _batch, _model

from tlt.config import RunConfig
from tlt.rl.update import make_updater
from tlt.rollout.weights import bits_sum, fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_jit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))


def test_a_one_ulp_change_changes_the_bit_sum():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.full((1000,), 100.0, dtype=dtype)
        before = bits_sum(t)
        t[7] = torch.nextafter(t[7], torch.tensor(200.0, dtype=dtype))  # smaller than fp32 rounding of a sum
        assert bits_sum(t) != before, dtype


@pytest.mark.parametrize("stage", [0, 2])
def test_a_deepspeed_step_changes_the_fingerprint(stage):
    cfg = RunConfig.model_validate({"trainer": {"backend": "deepspeed", "zero_stage": stage}, "rl": {"lr": 1e-3}})
    model = _model()
    updater = make_updater(model, cfg)
    try:
        for _ in range(2):
            before = fingerprint(model)
            weights = [t.detach().clone() for t in model.state_dict().values()]
            updater.step(_batch(model, True))
            assert any(not torch.equal(a, b) for a, b in zip(weights, model.state_dict().values()))
            assert fingerprint(model) != before
    finally:
        updater.close()


def test_an_untouched_model_keeps_its_fingerprint():
    model = _model()
    assert fingerprint(model) == fingerprint(model)
