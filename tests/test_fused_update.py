"""Fused old log-probs: the update's own forward gives the old log-probs and the drafter's features."""
import pytest
import torch

from tlt.config import RLConfig, RunConfig, TrainerConfig
from tlt.models import tiny_model
from tlt.rl.logprobs import forward_logprobs, make_batch
from tlt.rl.step import StepContext, Timer, _update
from tlt.rl.update import DeepSpeedUpdater, PolicyBatch, TorchUpdater, fuses_old_logprob

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11], [1, 12, 13]]
RESPONSES = [[20, 21, 22], [23, 24, 25, 26, 27], [28], [29, 30], [31, 32, 33, 34]]
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25])
AUX = [0, 1, 2]  # hidden_states ids of a 2-layer model: embeddings, layer 1, final norm
LR = 1e-3
ATOL = 1e-6  # parameters after one step, and log-probs
FEATURE_ATOL = 1e-5  # hidden states (values ~1) of forwards of different widths
STATS = ("policy/loss", "policy/entropy", "policy/grad_norm", "policy/clip_ratio", "policy/kl")


@pytest.fixture(autouse=True)
def _no_jit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))


def _model():
    return tiny_model(layers=2, hidden=128, vocab=64, seed=0)


def _tensors():
    return make_batch(PROMPTS, RESPONSES, pad_id=0)


def _batch(model, fused: bool, micro: int = len(PROMPTS)) -> PolicyBatch:
    """The update's batch; not fused: old_logp from a separate no-grad forward.

    That forward runs on the update's micro-batches (`micro` rows, trimmed) so that its shapes,
    hence its float rounding, are the update's: AdamW's first step moves a weight by
    lr * g / (|g| + eps), which turns rounding noise of a near-zero gradient into up to
    lr/eps = 1e5 times that in the weight, so two forwards of different widths differ by ~1e-5.
    """
    ids, attn, resp, pos = _tensors()
    batch = PolicyBatch(ids, attn, resp, None, ADV.clone(), position_ids=pos)
    if not fused:
        batch.old_logp = torch.zeros(ids.shape)
        with torch.no_grad():
            for start in range(0, len(batch), micro):
                mb = batch.slice(start, start + micro).trimmed()
                out = forward_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_mask,
                                       position_ids=mb.position_ids)
                batch.old_logp[start:start + micro, :out.logp.shape[1]] = out.logp
    return batch


def _reference(model):
    """A separate no-grad forward over the whole batch, with the drafter's hidden states."""
    ids, attn, resp, pos = _tensors()
    with torch.no_grad():
        return forward_logprobs(model, ids, attn, resp, aux_layer_ids=AUX, position_ids=pos)


def _assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, atol=ATOL, rtol=0)


def test_fused_step_equals_step_with_separate_old_logprob():
    separate, fused = _model(), _model()
    rl, trainer = RLConfig(lr=LR, entropy_coef=0.01), TrainerConfig(micro_batch_size=2)
    want = TorchUpdater(separate, rl, trainer).step(_batch(separate, fused=False, micro=2))
    got = TorchUpdater(fused, rl, trainer).step(_batch(fused, fused=True))
    for key in STATS:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert got["policy/clip_ratio"] == 0.0 and got["policy/kl"] == 0.0  # ratio exactly 1
    _assert_same_params(separate, fused)


def test_on_forward_hands_the_features_of_a_separate_forward():
    model = _model()
    ref = _reference(model)  # before the step: on_forward sees the pre-update policy
    calls = []
    TorchUpdater(model, RLConfig(lr=LR), TrainerConfig(micro_batch_size=2)).step(
        _batch(model, fused=True), aux_layer_ids=AUX, on_forward=lambda start, mb, out: calls.append((start, mb, out)))
    assert [start for start, _, _ in calls] == [0, 2, 4]  # micro 2 < batch 5, last one short
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    for start, mb, out in calls:
        assert mb.input_ids.shape[1] == max(lengths[start:start + len(mb)])  # trimmed micro-batch
        assert not any(t.requires_grad for t in (out.logp, out.entropy, out.aux, out.last_hidden))
        for j in range(len(mb)):
            i, n = start + j, lengths[start + j]
            torch.testing.assert_close(out.aux[j, :n], ref.aux[i, :n], atol=FEATURE_ATOL, rtol=1e-5)
            torch.testing.assert_close(out.last_hidden[j, :n], ref.last_hidden[i, :n], atol=FEATURE_ATOL, rtol=1e-5)
            torch.testing.assert_close(out.logp[j, :n], ref.logp[i, :n], atol=ATOL, rtol=1e-5)


def test_deepspeed_fused_step_equals_separate_old_logprob():
    trainer = TrainerConfig(backend="deepspeed", zero_stage=1, micro_batch_size=2)
    separate, fused = _model(), _model()
    ref = _reference(fused)
    results, seen = [], []
    for model, batch, kw in ((separate, _batch(separate, fused=False, micro=2), {}),
                             (fused, _batch(fused, fused=True),
                              {"aux_layer_ids": AUX, "on_forward": lambda start, mb, out: seen.append((start, out))})):
        updater = DeepSpeedUpdater(model, RLConfig(lr=LR), trainer)
        try:
            results.append(updater.step(batch, **kw))
        finally:
            updater.close()
    _assert_same_params(separate, fused)
    for key in ("policy/loss", "policy/entropy", "policy/grad_norm"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5), key
    assert [start for start, _ in seen] == [0, 2, 4]
    n = len(PROMPTS[1]) + len(RESPONSES[1])
    torch.testing.assert_close(seen[0][1].aux[1, :n], ref.aux[1, :n], atol=FEATURE_ATOL, rtol=1e-5)


class _Buffer:
    """Stands in for the drafter refresher: records the rows handed to the buffer."""

    aux_layer_ids = AUX

    def __init__(self):
        self.rows: dict[tuple[int, ...], tuple] = {}

    def add_rollouts(self, step, ids, attn, mask, aux, last_hidden):
        for i in range(len(ids)):
            n = int(attn[i].sum())
            key = tuple(ids[i, :n].tolist())
            assert key not in self.rows, "a row reached the drafter buffer twice"
            self.rows[key] = (mask[i, :n], aux[i, :n], last_hidden[i, :n])


def _run_update(fused: bool, keep=None, refresher=True, micro=2):
    cfg = RunConfig.model_validate({"rl": {"lr": LR, "fused_old_logprob": fused},
                                    "trainer": {"micro_batch_size": micro}})
    model = _model()
    ref = _reference(model)
    buf = _Buffer() if refresher else None
    ctx = StepContext(cfg=cfg, model=model, tokenizer=None, engine=None, updater=TorchUpdater(model, cfg.rl, cfg.trainer),
                      sampler=None, reward_fn=None, encode=None, refresher=buf)
    keep = torch.ones(len(PROMPTS), dtype=torch.bool) if keep is None else keep
    timer = Timer()
    metrics = _update(ctx, 0, _tensors(), ADV.clone(), keep, timer)
    return metrics, timer.s, buf, ref, model


def _assert_buffer_holds_every_row(buf, ref):
    ids, attn, resp, _ = _tensors()
    assert len(buf.rows) == len(ids)
    for i in range(len(ids)):
        n = int(attn[i].sum())
        mask, aux, last = buf.rows[tuple(ids[i, :n].tolist())]
        # the response tokens: the buffer weighs prompt positions itself (drafter.prompt_loss_weight)
        assert torch.equal(mask.bool(), resp[i, :n].bool()) and mask.any() and not mask.all()
        torch.testing.assert_close(aux, ref.aux[i, :n], atol=FEATURE_ATOL, rtol=1e-5)
        torch.testing.assert_close(last, ref.last_hidden[i, :n], atol=FEATURE_ATOL, rtol=1e-5)


@pytest.mark.parametrize("fused, forwards", [(True, 1.0), (False, 2.0)])
def test_update_counts_forwards_and_feeds_the_buffer(fused, forwards):
    metrics, timings, buf, ref, _ = _run_update(fused)
    assert metrics["perf/target_forwards_per_sample"] == forwards
    assert ("old_logprob" in timings) == (not fused) and "update_policy" in timings
    assert metrics["policy/clip_ratio"] == 0.0
    _assert_buffer_holds_every_row(buf, ref)


def test_update_same_parameters_fused_or_not():
    # One micro-batch: the separate forward has the update's shapes (see `_batch` on rounding).
    *_, fused = _run_update(True, micro=len(PROMPTS))
    *_, separate = _run_update(False, micro=len(PROMPTS))
    _assert_same_params(separate, fused)


def test_filtered_rows_still_reach_the_buffer():
    keep = torch.tensor([True, False, True, False, True])
    metrics, timings, buf, ref, _ = _run_update(True, keep=keep)
    assert metrics["perf/target_forwards_per_sample"] == 1.0  # 2 separate + 3 in the update
    assert "old_logprob" in timings
    _assert_buffer_holds_every_row(buf, ref)
    metrics, timings, buf, ref, _ = _run_update(True, keep=torch.zeros(5, dtype=torch.bool))
    assert metrics["perf/target_forwards_per_sample"] == 1.0 and "update_policy" not in timings
    _assert_buffer_holds_every_row(buf, ref)


def test_no_drafter_no_extra_forward():
    metrics, timings, *_ = _run_update(True, refresher=False)
    assert metrics["perf/target_forwards_per_sample"] == 1.0 and "old_logprob" not in timings
    metrics, timings, *_ = _run_update(True, keep=torch.tensor([True, False, True, False, True]), refresher=False)
    assert metrics["perf/target_forwards_per_sample"] == pytest.approx(3 / 5) and "old_logprob" not in timings


def test_kl_reference_keeps_the_separate_forward():
    assert fuses_old_logprob(RunConfig())
    assert not fuses_old_logprob(RunConfig.model_validate({"rl": {"fused_old_logprob": False}}))
    assert not fuses_old_logprob(RunConfig.model_validate({"rl": {"kl_coef": 0.1}}))
