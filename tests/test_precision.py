"""Mixed precision: fp32 master weights that small updates really move, bf16 compute, the rollout's
bf16 copy rounded from the masters, resolution of 'auto', and the config checks that refuse a pure
low-precision update."""
import copy

import pytest
import torch

from tlt import precision
from tlt.checkpoint import load_checkpoint, save_checkpoint
from tlt.config import RLConfig, RolloutConfig, RunConfig, TrainerConfig, load_config
from tlt.models import tiny_model
from tlt.rl.logprobs import make_batch
from tlt.rl.update import DeepSpeedUpdater, PolicyBatch, TorchUpdater
from tlt.rollout import RolloutEngine
from tlt.versions import bump

PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11]]
RESPONSES = [[20, 21, 22], [23, 24, 25, 26, 27], [28], [29, 30]]
SMALL_LR = 1e-6  # the GPU recipe's policy lr


@pytest.fixture(autouse=True)
def _no_jit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))


def _batch() -> PolicyBatch:
    ids, attn, resp, pos = make_batch(PROMPTS, RESPONSES, pad_id=0)
    return PolicyBatch(ids, attn, resp, None, torch.tensor([1.0, -1.0, 0.5, -0.5]), position_ids=pos)


def _live_gradients(model, trainer: TrainerConfig) -> dict[str, torch.Tensor]:
    """Which elements get a gradient that AdamW surely turns into a step of ~lr: |g| > 1e-5, 1000 x
    Adam's eps (a step >= 0.999 lr, above the fp32 spacing of weights up to 4, 4.8e-7). Unused
    embedding rows get none; gradients under eps give steps of lr*g/eps, which even fp32 rounds
    away. The gradients of the same step (micro-batches, precision) through TorchUpdater on a copy,
    read by hooks (ZeRO-2 reduces its gradients into its own buffers, out of their reach)."""
    ref = copy.deepcopy(model)
    grads: dict[str, torch.Tensor] = {}
    for n, p in ref.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.detach().clone()))
    TorchUpdater(ref, RLConfig(lr=SMALL_LR, weight_decay=0.0), trainer.model_copy(update={"backend": "torch",
                                                                                          "zero_stage": 0})
                 ).step(_batch())
    return {n: g.abs() > 1e-5 for n, g in grads.items()}


def _moved_share(updater_cls, model, trainer: TrainerConfig) -> float:
    """Share of the trainable weights with a non-zero gradient that one AdamW step at SMALL_LR changed."""
    live = _live_gradients(model, trainer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    upd = updater_cls(model, RLConfig(lr=SMALL_LR, weight_decay=0.0), trainer)
    try:
        upd.step(_batch())
    finally:
        upd.close()
    moved = sum(int(((p.detach() != before[n]) & live[n]).sum()) for n, p in model.named_parameters() if n in live)
    return moved / sum(int(m.sum()) for m in live.values())


@pytest.mark.parametrize("backend, stage", [("torch", 0), ("deepspeed", 2)])
def test_bf16_mixed_moves_every_master_weight_at_lr_1e6(backend, stage):
    """fp32 master weights + bf16 compute: every weight with a gradient moves at lr 1e-6, while the
    same step on bf16 weights (the bug this replaces) rounds almost all of them away."""
    cls = TorchUpdater if backend == "torch" else DeepSpeedUpdater
    no_clip = 1e9  # a clip would scale gradients toward eps, where Adam's step shrinks
    mixed = TrainerConfig(backend=backend, zero_stage=stage, micro_batch_size=2, precision="bf16-mixed",
                          grad_clip=no_clip)
    share = _moved_share(cls, tiny_model(layers=2, hidden=128, vocab=64, seed=0), mixed)
    assert share == 1.0
    pure = TrainerConfig(backend=backend, zero_stage=stage, micro_batch_size=2, precision="fp32", grad_clip=no_clip)
    pure_share = _moved_share(cls, tiny_model(layers=2, hidden=128, vocab=64, seed=0).to(torch.bfloat16), pure)
    assert pure_share < 0.2  # negative control: in-place bf16 updates lose most steps at this lr


def test_bf16_mixed_loss_is_the_fp32_loss_to_bf16_rounding():
    """Autocast changes the matmuls' precision, not the loss: the same step's loss agrees to bf16's
    resolution (8 significant bits, ~0.4 % relative, summed over a few layers) and gradients flow."""
    losses = {}
    for prec in ("fp32", "bf16-mixed"):
        model = tiny_model(layers=2, hidden=128, vocab=64, seed=0)
        m = TorchUpdater(model, RLConfig(lr=1e-3), TrainerConfig(micro_batch_size=2, precision=prec)).step(_batch())
        losses[prec] = m["policy/entropy"]
        assert m["policy/grad_norm"] > 0 and next(model.parameters()).dtype == torch.float32
    assert losses["bf16-mixed"] == pytest.approx(losses["fp32"], rel=0.02)


def test_rollout_copy_is_the_master_rounded_to_bf16_after_a_sync(tmp_path):
    """The engine's bf16 copy equals the fp32 masters rounded after every update (the updater bumps
    the policy's version, so DeepSpeed ZeRO-2's in-place writes count too), and a checkpoint keeps the
    fp32 masters exactly."""
    model = tiny_model(layers=2, hidden=128, vocab=64, seed=0)
    engine = RolloutEngine(model, RolloutConfig(dtype="bfloat16", max_new_tokens=4, temperature=0.0), [2], 0)
    assert next(engine.model.parameters()).dtype == torch.bfloat16 and engine.model is not model
    upd = DeepSpeedUpdater(model, RLConfig(lr=1e-3), TrainerConfig(backend="deepspeed", zero_stage=2,
                                                                   precision="bf16-mixed"))
    try:
        upd.step(_batch())
    finally:
        upd.close()
    assert engine.sync(model) == {"rollout/weights_copied": 1.0}
    assert engine.sync(model) == {"rollout/weights_copied": 0.0}  # nothing changed since
    copy = engine.model.state_dict()
    for name, master in model.state_dict().items():
        assert master.dtype == torch.float32 and torch.equal(copy[name], master.to(torch.bfloat16)), name
    path = save_checkpoint(tmp_path, 0, {"policy": model.state_dict()}, {"step": 0})
    restored = load_checkpoint(path)[0]["policy"]
    assert all(torch.equal(restored[k], v) for k, v in model.state_dict().items())  # fp32, bit for bit


def test_rollout_copy_follows_a_change_outside_a_step():
    """A resume or load writes the masters (and bumps their version) without a sync: the next
    generate sees it."""
    model = tiny_model(layers=2, hidden=128, vocab=64, seed=0)
    engine = RolloutEngine(model, RolloutConfig(dtype="bfloat16", max_new_tokens=6, temperature=0.0), [2], 0)
    before = engine.generate([[1, 5, 9]], spec=False).response_ids
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    bump(model)
    after = engine.generate([[1, 5, 9]], spec=False).response_ids
    assert after != before and torch.equal(engine.model.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


@pytest.mark.parametrize("supported, want", [(True, "bf16-mixed"), (False, "fp32")])
def test_auto_resolves_per_hardware_with_a_reason(monkeypatch, supported, want):
    monkeypatch.setattr(precision, "bf16_support", lambda device="cpu": (supported, "because"))
    cfg, notes = precision.resolve_run(RunConfig.model_validate({"trainer": {"precision": "auto"}}), device="cpu")
    assert cfg.trainer.precision == cfg.drafter.precision == want
    assert cfg.rollout.dtype == ("bfloat16" if supported else "float32")
    assert any("because" in n for n in notes)
    pinned, _ = precision.resolve_run(RunConfig.model_validate({"trainer": {"precision": "fp32"},
                                                                "rollout": {"dtype": "bfloat16"}}), device="cpu")
    assert (pinned.trainer.precision, pinned.drafter.precision, pinned.rollout.dtype) == ("fp32", "fp32", "bfloat16")


def test_default_is_auto_resolved_per_hardware():
    """The default is auto (bench/results/precision_parity_default.json: bf16-mixed learns as fp32
    does over seeds); a run resolves it to bf16-mixed only where the hardware has bf16 units."""
    assert RunConfig().trainer.precision == "auto"
    cfg, _ = precision.resolve_run(RunConfig(), device="cpu")
    want = "bf16-mixed" if precision.bf16_support("cpu")[0] else "fp32"
    assert (cfg.trainer.precision, cfg.drafter.precision) == (want, want)
    assert cfg.rollout.dtype == ("bfloat16" if want == "bf16-mixed" else "float32")


def test_components_given_auto_compute_in_fp32():
    assert precision.compute_dtype("auto") is None and precision.compute_dtype("bf16-mixed") == torch.bfloat16
    with pytest.raises(ValueError, match="precision must be one of"):
        precision.compute_dtype("bf16")


def test_pure_low_precision_update_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="trainer.precision: bf16-mixed") as err:
        RunConfig.model_validate({"model": {"dtype": "bfloat16"}, "rl": {"lr": 1e-6}})
    assert "model.dtype: float32" in str(err.value) and "allow_low_precision_update" in str(err.value)
    with pytest.raises(ValueError, match="keeps fp32 master weights"):
        RunConfig.model_validate({"model": {"dtype": "bfloat16"}, "trainer": {"precision": "bf16-mixed"}})
    RunConfig.model_validate({"model": {"dtype": "bfloat16"}, "trainer": {"allow_low_precision_update": True}})
    RunConfig.model_validate({"model": {"dtype": "bfloat16"}, "rl": {"steps": 0}})  # evaluation only: no update


def test_gpu_recipe_trains_fp32_masters_in_bf16():
    cfg = load_config("conf/gpu-8x.yaml")
    assert cfg.model.dtype == "float32" and cfg.trainer.precision == "bf16-mixed" and cfg.rollout.dtype == "bfloat16"
