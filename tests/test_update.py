"""Old-log-prob forward, and the torch / DeepSpeed policy updates on a tiny random model."""
import io

import pytest
import torch

from tlt.config import RLConfig, RunConfig, TrainerConfig
from tlt.models import tiny_model
from tlt.rl.grpo import kl_k3
from tlt.rl.logprobs import forward_logprobs, make_batch
from tlt.rl.update import DeepSpeedUpdater, PolicyBatch, TorchUpdater, make_updater, micro_batch_loss

PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11]]
RESPONSES = [[20, 21, 22], [23, 24, 25, 26, 27], [28], [29, 30]]
LR = 1e-3  # large enough that one step moves every parameter visibly
# torch vs DeepSpeed after one AdamW step: the micro-batches' gradients are summed in another order.
# Step 1 moves an element by lr*g/(|g|+eps); a rounding difference d in g moves that by at most
# lr*d/(4*eps) (at |g| = eps), and d <= ~2^-24 x the element's partial sums (<= 1e-2 on this tiny
# model): <= 1.5 % of lr in the worst element, whatever the CPU. A wrong update is off by ~lr.
PARAM_ATOL = 0.02 * LR


@pytest.fixture(autouse=True)
def _no_jit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))


def _model(seed=0):
    return tiny_model(layers=2, hidden=128, vocab=64, seed=seed)


def _batch(model, ref_model=None) -> PolicyBatch:
    ids, attn, resp, pos = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        old = forward_logprobs(model, ids, attn, resp, position_ids=pos).logp
        ref = None if ref_model is None else forward_logprobs(ref_model, ids, attn, resp, position_ids=pos).logp
    return PolicyBatch(ids, attn, resp, old, torch.tensor([1.0, -1.0, 0.5, -0.5]), ref_logp=ref, position_ids=pos)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_make_batch_layout():
    ids, attn, resp, pos = make_batch([[1, 2], [3]], [[4], [5, 6, 7]], pad_id=0)
    assert ids.tolist() == [[1, 2, 4, 0], [3, 5, 6, 7]]
    assert attn.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert resp.tolist() == [[False, False, True, False], [False, True, True, True]]
    assert pos.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]


def test_logp_matches_unbatched_forward_and_aux_shapes():
    model = _model()
    ids, attn, resp, pos = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        out = forward_logprobs(model, ids, attn, resp, aux_layer_ids=[0, 1, 2], temperature=0.7,
                               with_entropy=True, position_ids=pos)
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            seq = torch.tensor([p + r])
            logits = model(seq).logits[0, :-1] / 0.7
            want = logits.log_softmax(-1).gather(-1, seq[0, 1:, None])[:, 0][len(p) - 1:]
            torch.testing.assert_close(out.logp[i, len(p):len(p) + len(r)], want, atol=1e-5, rtol=1e-5)
            assert out.logp[i, :len(p)].abs().sum() == 0 and out.logp[i, len(p) + len(r):].abs().sum() == 0
    b, t = ids.shape
    assert out.aux.shape == (b, t, 3 * 128) and out.last_hidden.shape == (b, t, 128)
    assert out.entropy.shape == (b, t) and (out.entropy[resp] > 0).all() and (out.entropy[~resp] == 0).all()


def test_torch_step_changes_parameters_and_reports_metrics():
    model = _model()
    before = _params(model)
    metrics = TorchUpdater(model, RLConfig(lr=LR), TrainerConfig(micro_batch_size=2)).step(_batch(model))
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for name in ("loss", "kl", "entropy", "clip_ratio", "grad_norm", "lr"):
        assert f"policy/{name}" in metrics
    assert metrics["policy/lr"] == LR and metrics["policy/grad_norm"] > 0
    assert metrics["policy/clip_ratio"] == 0.0  # ratio is exactly 1 at the first step
    assert not model.training  # the caller's mode is restored


def test_micro_batches_give_the_full_batch_gradient():
    model, rl = _model(), RLConfig(lr=LR, entropy_coef=0.01)
    batch = _batch(model)
    denom = float(batch.response_mask.sum())
    micro_batch_loss(model, batch, rl, denom)[0].backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for i in range(len(batch)):
        micro_batch_loss(model, batch.slice(i, i + 1), rl, denom)[0].backward()
    for a, p in zip(full, model.parameters()):
        torch.testing.assert_close(p.grad, a, atol=1e-6, rtol=1e-5)
    # Same through the updater: the reported pre-clip norm does not depend on the micro size.
    norms = [TorchUpdater(_model(), rl, TrainerConfig(micro_batch_size=m)).step(batch)["policy/grad_norm"] for m in (1, 4)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_deepspeed_matches_torch_after_one_step(stage):
    ref_model, ds_model = _model(), _model()
    batch = _batch(ref_model)
    rl = RLConfig(lr=LR)
    want = TorchUpdater(ref_model, rl, TrainerConfig(micro_batch_size=4)).step(batch)
    updater = DeepSpeedUpdater(ds_model, rl, TrainerConfig(backend="deepspeed", zero_stage=stage, micro_batch_size=2))
    try:
        got = updater.step(batch)
    finally:
        updater.close()
    for a, b in zip(ref_model.parameters(), ds_model.parameters()):
        torch.testing.assert_close(b, a, atol=PARAM_ATOL, rtol=0)
    for key in ("policy/loss", "policy/entropy", "policy/grad_norm", "policy/lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5)


def test_reference_kl_term_pulls_toward_the_reference():
    model, ref = _model(seed=0), _model(seed=1)
    batch = _batch(model, ref_model=ref)
    batch.advantages = torch.zeros(len(batch))  # only the KL term has a gradient
    metrics = TorchUpdater(model, RLConfig(lr=LR, kl_coef=1.0), TrainerConfig()).step(batch)
    want = kl_k3(batch.old_logp, batch.ref_logp, batch.response_mask).item()
    assert metrics["policy/kl"] == pytest.approx(want, rel=1e-5) and want > 0
    with torch.no_grad():
        after = forward_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask).logp
    assert kl_k3(after, batch.ref_logp, batch.response_mask).item() < want
    with pytest.raises(ValueError, match="ref_logp"):
        TorchUpdater(model, RLConfig(kl_coef=1.0), TrainerConfig()).step(_batch(model))


def _resume_matches_continuous(make):
    """Two steps in a row == step, save optimizer state (weights_only), new updater, load, step."""
    batch = _batch(_model())
    straight = _model()
    u = make(straight)
    u.step(batch), u.step(batch)
    u.close()
    first = _model()
    u = make(first)
    u.step(batch)
    buf = io.BytesIO()
    torch.save({"opt": u.state_dict()}, buf)
    u.close()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # what a checkpoint reload does
    resumed = _model()
    resumed.load_state_dict(first.state_dict())
    u = make(resumed)
    u.load_state_dict(loaded["opt"])
    u.step(batch)
    u.close()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, atol=PARAM_ATOL, rtol=0)


def test_torch_optimizer_state_round_trip():
    _resume_matches_continuous(lambda m: TorchUpdater(m, RLConfig(lr=LR), TrainerConfig()))


def test_deepspeed_zero2_optimizer_state_round_trip():
    trainer = TrainerConfig(backend="deepspeed", zero_stage=2, micro_batch_size=2)
    _resume_matches_continuous(lambda m: DeepSpeedUpdater(m, RLConfig(lr=LR), trainer))


def test_make_updater_picks_the_backend():
    cfg = RunConfig.model_validate({"trainer": {"backend": "deepspeed", "zero_stage": 1}})
    assert isinstance(make_updater(_model(), cfg), DeepSpeedUpdater)
    assert isinstance(make_updater(_model(), RunConfig()), TorchUpdater)


def test_update_in_length_order_equals_rollout_order_with_less_padding():
    """Rows sorted by length (trainer.group_by_length) give the same step as rollout order (the loss
    is a token sum over the batch: only fp32 summation order differs) with less padding."""
    from tlt.rl.step import padding_share, update_order
    prompts, responses = PROMPTS * 2, [r * 9 if i % 3 == 0 else r for i, r in enumerate(RESPONSES * 2)]
    ids, attn, resp, pos = make_batch(prompts, responses, pad_id=0)
    keep = torch.tensor([True, True, False, True, True, True, True, True])
    adv = torch.linspace(-1, 1, len(ids))
    lengths = attn.sum(1)
    models, results = (_model(), _model()), []
    for model, by_length in zip(models, (False, True)):
        idx = update_order(attn, keep, by_length)
        assert sorted(idx.tolist()) == torch.nonzero(keep).squeeze(1).tolist()  # every kept row, once
        assert by_length == bool((lengths[idx][:-1] >= lengths[idx][1:]).all())
        batch = PolicyBatch(ids[idx], attn[idx], resp[idx], None, adv[idx], position_ids=pos[idx])
        metrics = TorchUpdater(model, RLConfig(lr=LR), TrainerConfig(micro_batch_size=2)).step(batch)
        results.append((metrics, padding_share(lengths[idx], 2)))
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, atol=PARAM_ATOL, rtol=0)
    for key in ("policy/loss", "policy/entropy", "policy/grad_norm"):
        assert results[1][0][key] == pytest.approx(results[0][0][key], rel=1e-5), key
    assert results[1][1] < results[0][1]  # 0.16 vs 0.33 here
