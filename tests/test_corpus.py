"""The drafter's self-distilled corpus, the honest accept length, and the EAGLE-3 training recipe
(LR schedule, prompt-position weights): real reasoning-gym prompts, a tiny random target."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig, SpecStrategy, load_config
from tlt.prompts import load_dataset, prompt_ids
from tlt.corpus import build_corpus, vocab_coverage
from tlt.drafter.model import build_drafter
from tlt.drafter.train import DrafterTrainer, collect_samples, pack
from tlt.models import eos_token_ids, load_target
from tlt.rollout import RolloutEngine, StrategyTuner
from tlt.rollout.acceptance import measure_accept

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("conf/smoke.yaml", ["drafter.corpus_tokens=300", "drafter.corpus_prompts_per_batch=16"])
    model, tok = load_target(cfg.model)
    ds = load_dataset(cfg.data, tok)
    eng = RolloutEngine(model, cfg.rollout, eos_token_ids(tok, model), tok.pad_token_id)
    enc = lambda texts: [prompt_ids(tok, t, cfg.data.instruction, cfg.data.system_prompt) for t in texts]  # noqa: E731
    return cfg, model, tok, ds, eng, enc


def test_corpus_budget_fresh_prompts_and_cache(setup, tmp_path):
    cfg, model, tok, ds, eng, enc = setup
    held = ds.heldout["prompt"].tolist()
    c = build_corpus(eng, enc, cfg, ds.train["prompt"].tolist(), held, tmp_path, "fp")
    assert c.n_tokens >= cfg.drafter.corpus_tokens and not c.cached and c.path.exists()
    assert set(c.temperatures) == {0.0, cfg.rollout.temperature}  # greedy + rollout temperature
    held_ids = {tuple(p) for p in enc(held)}
    assert not held_ids & {tuple(p) for p in c.prompt_ids}  # held-out prompts never enter the corpus
    assert all(0 < len(r) <= cfg.drafter.warmstart_max_new_tokens for r in c.response_ids)
    again = build_corpus(eng, enc, cfg, ds.train["prompt"].tolist(), held, tmp_path, "fp")
    assert again.cached and again.key == c.key
    assert again.prompt_ids == c.prompt_ids and again.response_ids == c.response_ids
    bigger = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"corpus_tokens": 600})})
    assert build_corpus(eng, enc, bigger, ds.train["prompt"].tolist(), held, tmp_path, "fp").key != c.key
    # A user dataset (data.path) cycles its own training prompts.
    user = cfg.model_copy(update={"data": cfg.data.model_copy(update={"path": "x.jsonl"})})
    cu = build_corpus(eng, enc, user, ds.train["prompt"].tolist()[:3], held, tmp_path, "fp")
    assert {tuple(p) for p in cu.prompt_ids} <= {tuple(p) for p in enc(ds.train["prompt"].tolist()[:3])}
    assert cu.temperatures.count(0.0) <= 3  # greedy once per distinct prompt, later passes sampled


def test_vocab_coverage():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2, 3]] = True
    assert vocab_coverage(t2d, [[1, 2], [3, 4]]) == 0.75
    assert vocab_coverage(None, [[5]]) == 1.0


def test_measure_accept_is_tuner_free_and_restores_the_engine(setup):
    """The accept length does not depend on a tuner: same number with or without one, the tuner
    learns nothing from it, and the engine's config, tuner and prompt history come back unchanged."""
    cfg, model, tok, ds, _, enc = setup
    torch.manual_seed(0)
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=0)).eval()
    prompts = enc(ds.heldout["prompt"].tolist())
    rc = cfg.rollout.model_copy(update={"drafter": "eagle", "spec_threshold": 1, "draft_min_prob": 0.5})
    tuner = StrategyTuner.default(rc.tuner_buckets, plain=True)
    before = tuner.state()
    eng = RolloutEngine(model, rc, eos_token_ids(tok, model), tok.pad_token_id, drafter=drafter, tuner=tuner)
    history = eng.history
    a = measure_accept(eng, prompts, 0.0, 8, SpecStrategy(depth=3, topk=1, tokens=3), batch_size=2)
    assert tuner.state() == before and eng.cfg == rc and eng.tuner is tuner
    assert eng.history is history and len(history) == 0  # the measurement's answers are not kept
    plain = RolloutEngine(model, rc, eos_token_ids(tok, model), tok.pad_token_id, drafter=drafter)
    b = measure_accept(plain, prompts, 0.0, 8, SpecStrategy(depth=3, topk=1, tokens=3), batch_size=4)
    assert a.accept_len == b.accept_len and a.responses == b.responses and 1.0 <= a.accept_len <= 4.0
    ref = plain.generate(prompts, max_new_tokens=8, temperature=0.0, spec=False).response_ids
    assert a.responses == [list(r) for r in ref]  # greedy SD is lossless
    with pytest.raises(ValueError, match="plain"):
        measure_accept(plain, prompts, 0.0, 8, SpecStrategy(depth=0, topk=1, tokens=0))


def test_warmup_cosine_schedule_then_constant(setup):
    _, model, *_ = setup
    d = build_drafter(model, DrafterConfig(draft_vocab_size=0))
    cfg = DrafterConfig(draft_vocab_size=0, lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1)
    tr = DrafterTrainer(d, cfg, model.get_output_embeddings().weight)
    tr.schedule(100)
    lrs = []
    for i in range(100):
        lrs.append(tr.lr_now())
        tr.num_steps += 1
    assert lrs[0] < lrs[5] < lrs[9] <= 1e-3  # warmup
    assert max(lrs) == pytest.approx(1e-3, rel=1e-6) and lrs[-1] == pytest.approx(1e-4, rel=0.05)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine: monotone down
    tr.constant_lr()  # online refreshes: where the cosine ended, unless refresh_lr is set
    assert tr.lr_now() == pytest.approx(1e-4) and tr.opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    fixed = DrafterTrainer(d, cfg.model_copy(update={"refresh_lr": 5e-4}), model.get_output_embeddings().weight)
    assert fixed.opt.param_groups[0]["lr"] == 5e-4


def test_prompt_weight_zero_equals_response_only(setup):
    """loss_weight 0 on prompt positions trains exactly what response-only masks train; TTT decay
    changes the loss."""
    _, model, *_ = setup
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (12, 17, 9)]
    d = build_drafter(model, DrafterConfig(draft_vocab_size=0))
    base = collect_samples(model, seqs, [5, 6, 4], d.aux_layer_ids)
    weighted = []
    for s in base:
        w = dict(s)
        w["loss_weight"] = torch.where(s["loss_mask"], 1.0, 0.0)
        w["loss_mask"] = torch.arange(len(s["loss_mask"])) >= 1
        weighted.append(w)
    cfg = DrafterConfig(draft_vocab_size=0, ttt_steps=3, ttt_decay=0.5)
    tr = DrafterTrainer(d, cfg, model.get_output_embeddings().weight)
    la, ma = tr.compute_loss(pack(base, 512)[0])
    lb, mb = tr.compute_loss(pack(weighted, 512)[0])
    assert torch.allclose(la, lb, atol=1e-6) and ma["drafter/tokens"] == mb["drafter/tokens"]
    flat = DrafterTrainer(d, cfg.model_copy(update={"ttt_decay": 1.0}), model.get_output_embeddings().weight)
    lf, _ = flat.compute_loss(pack(base, 512)[0])
    assert not math.isclose(lf.item(), la.item(), rel_tol=1e-6)


def test_captured_features_equal_a_second_forward(setup):
    """generate(capture=) records what a fresh forward over prompt + response computes (left vs
    right padding, incremental KV vs one pass: fp32 noise only), group members included."""
    cfg, model, tok, ds, eng, enc = setup
    prompts = enc(ds.heldout["prompt"].tolist()[:3])
    ids = [1, 2, 3]
    out = eng.generate(prompts, group_size=2, max_new_tokens=6, temperature=1.0, seed=3, spec=False, capture=ids)
    ref = collect_samples(model, [p + r for p, r in zip(out.prompt_ids, out.response_ids)],
                          [len(p) for p in out.prompt_ids], ids)
    for (aux, fin), s, r in zip(out.features, ref, out.response_ids):
        T = len(s["input_ids"])
        assert aux.shape == s["aux"].shape and fin.shape == s["target_hidden"].shape
        # every position but the last response token (never fed to the target) is recorded
        torch.testing.assert_close(aux[: T - 1], s["aux"][: T - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fin[: T - 1], s["target_hidden"][: T - 1], atol=1e-4, rtol=1e-4)
        assert float(aux[T - 1].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="spec=False"):
        eng.generate(prompts, capture=ids, spec=True)


def test_engines_without_capture_build_a_corpus_without_features(setup, tmp_path):
    """vLLM / worker engines have no `capture`: the corpus is built anyway, features left to a re-forward."""
    cfg, model, tok, ds, eng, enc = setup

    class NoCapture:  # what it can do: the torch engine's, less `capture`
        capabilities = dataclasses.replace(eng.capabilities, capture=False)

        def generate(self, prompts, max_new_tokens=None, temperature=None, top_p=None, seed=0, spec=None):
            return eng.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                seed=seed, spec=spec)

    c = build_corpus(NoCapture(), enc, cfg, ds.train["prompt"].tolist(), ds.heldout["prompt"].tolist(), tmp_path,
                     "fp", capture=[1, 2, 3])
    assert c.features is None and c.n_tokens >= cfg.drafter.corpus_tokens
    withf = build_corpus(eng, enc, cfg, ds.train["prompt"].tolist(), ds.heldout["prompt"].tolist(),
                         tmp_path / "b", "fp", capture=[1, 2, 3])
    assert withf.features is not None and len(withf.features) == len(withf)


def test_corpus_samples_one_per_sequence(setup, tmp_path):
    """Captured features are used as they are: one sample per corpus sequence, no re-forward added."""
    from tlt.distill import corpus_samples

    cfg, model, tok, ds, eng, enc = setup
    c = build_corpus(eng, enc, cfg, ds.train["prompt"].tolist(), ds.heldout["prompt"].tolist(), tmp_path, "fp",
                     capture=[1, 2, 3])
    s = corpus_samples(model, c, [1, 2, 3], cfg)
    assert len(s) == len(c)
    c.features = None
    r = corpus_samples(model, c, [1, 2, 3], cfg)
    assert len(r) == len(c)
    torch.testing.assert_close(s[0]["target_hidden"][:-1], r[0]["target_hidden"][:-1], atol=1e-4, rtol=1e-4)
