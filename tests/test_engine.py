"""Rollout engine: plain decoding vs HF generate, prefill once per group, log-probs, EOS and
length limits, the exact sampling distribution of speculative decoding, metrics."""
import math

import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig, SpecStrategy
from tlt.drafter.model import build_drafter
from tlt.metrics import rollout_metrics
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine, StrategyTuner

CHAIN = SpecStrategy(depth=4, topk=1, tokens=4)
TREE = SpecStrategy(depth=4, topk=3, tokens=10)


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(n, vocab, seed, lo=3, hi=14):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _engine(model, eos=(2,), tuner=None, **kw):
    base = dict(max_new_tokens=20, temperature=0.0, spec_threshold=100, tuner=False, drafter="ngram")
    base.update(kw)
    return RolloutEngine(model, RolloutConfig(**base), eos_ids=list(eos), pad_id=0, tuner=tuner)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, vocab=64, seed=1)


def test_plain_greedy_equals_hf_generate(model):
    prompts = _prompts(6, 64, seed=0)
    out = _engine(model).generate(prompts, spec=False)
    for p, r in zip(prompts, out.response_ids):
        hf = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=0)
        hf = hf[0, len(p):].tolist()
        assert r == hf[: len(r)] and (len(r) == 20 or r[-1] == 2)


def test_batch_composition_does_not_change_greedy(model):
    """Rows leaving the batch (cache rows dropped, cache compacted) leave the others unchanged."""
    prompts = _prompts(8, 64, seed=2)
    batched = _engine(model).generate(prompts, spec=False)
    alone = [_engine(model).generate([p], spec=False).response_ids[0] for p in prompts]
    assert batched.response_ids == alone


def test_prefill_once_per_group_and_seeded(model):
    eng = _engine(model, eos=())
    eng.forward_calls = 0
    out = eng.generate([[5, 6, 7]], group_size=8, max_new_tokens=1, temperature=1.0, seed=3, spec=False)
    assert eng.forward_calls == 1 and len(set(r[0] for r in out.response_ids)) > 1
    eng.forward_calls = 0
    out = eng.generate([[5, 6, 7], [9, 9]], group_size=4, max_new_tokens=5, temperature=1.0, seed=3, spec=False)
    assert eng.forward_calls == 1 + 4 and out.group_index == [0] * 4 + [1] * 4
    again = eng.generate([[5, 6, 7], [9, 9]], group_size=4, max_new_tokens=5, temperature=1.0, seed=3, spec=False)
    assert again.response_ids == out.response_ids


@pytest.mark.parametrize("spec", [False, True])
def test_logprobs_match_fresh_forward(model, spec):
    prompts = _prompts(5, 64, seed=4)
    out = _engine(model, strategy=TREE).generate(prompts, group_size=2, temperature=0.7, top_p=0.9, spec=spec)
    for p, r, lp in zip(out.prompt_ids, out.response_ids, out.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1: -1]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(lp), ref, atol=1e-4)


def test_eos_inside_drafts_and_max_new(model):
    prompts = _prompts(10, 64, seed=5)
    base = _engine(model, eos=()).generate(prompts, spec=False)
    # A token that occurs mid-response (often inside an accepted n-gram draft) becomes the EOS.
    eos = base.response_ids[0][6]
    plain = _engine(model, eos=(eos,)).generate(prompts, spec=False)
    sd = _engine(model, eos=(eos,), strategy=TREE).generate(prompts, spec=True)
    assert sd.response_ids == plain.response_ids and sd.finished_eos == plain.finished_eos
    for r, fin in zip(sd.response_ids, sd.finished_eos):
        assert len(r) <= 20
        assert (r[-1] == eos) == fin and eos not in r[:-1]
        assert fin or len(r) == 20
    short = _engine(model, eos=(), strategy=TREE).generate(prompts, max_new_tokens=3, spec=True)
    assert all(len(r) == 3 for r in short.response_ids)


def _exact_joint(model, prompt, temperature, top_p, n_tokens=2):
    """Exact probability of every n_tokens continuation under top-p(softmax(logits / T))."""
    from tlt.rollout.torch_engine.sampling import target_probs
    vocab = model.config.vocab_size
    seqs, probs = [[]], torch.ones(1)
    with torch.no_grad():
        for _ in range(n_tokens):
            ids = torch.tensor([prompt + s for s in seqs])
            p = target_probs(model(input_ids=ids).logits[:, -1].float(), temperature, top_p)  # [S, V]
            probs = (probs[:, None] * p).reshape(-1)
            seqs = [s + [t] for s in seqs for t in range(vocab)]
    return {tuple(s): float(q) for s, q in zip(seqs, probs)}


@pytest.mark.parametrize("kind,strategy,top_p,dtype", [  # the n-gram cases take ~20-30 s each: slow tier
    pytest.param("ngram", CHAIN, 1.0, "float32", marks=pytest.mark.slow),
    pytest.param("ngram", SpecStrategy(depth=3, topk=3, tokens=6), 0.9, "float32", marks=pytest.mark.slow),
    ("eagle", SpecStrategy(depth=2, topk=2, tokens=4), 1.0, "float32"),
    ("eagle-pruned", SpecStrategy(depth=3, topk=2, tokens=6), 1.0, "float32"),
    ("eagle", SpecStrategy(depth=2, topk=2, tokens=4), 1.0, "bfloat16")])
def test_sampling_distribution_matches_policy(kind, strategy, top_p, dtype):
    """TV(empirical SD samples, exact policy) of the first 2 tokens within a sample-size bound. In a
    bf16 rollout (rollout.dtype) the policy is the bf16 copy's: lossless relative to its own dtype."""
    model = tiny_model("llama", layers=2, vocab=16, seed=3)
    prompt = [5, 6, 7, 5, 6, 8, 5, 6, 9, 3, 5, 6]  # the suffix "5 6" has three continuations -> drafts
    n = 3000
    eng = _engine(model, eos=(), spec_threshold=n, strategy=strategy, max_new_tokens=2, dtype=dtype)
    if kind.startswith("eagle"):  # a random EAGLE-3 drafter: its q differs from p, so rejections happen
        update = {"drafter": "eagle", "draft_min_prob": 0.01 if kind == "eagle-pruned" else 0.0}
        eng = RolloutEngine(model, eng.cfg.model_copy(update=update), eos_ids=[], pad_id=0,
                            drafter=build_drafter(model, DrafterConfig(draft_vocab_size=0)).eval())
    out = eng.generate([prompt], group_size=n, temperature=1.0, top_p=top_p, seed=11, spec=True)
    exact = _exact_joint(model.to(getattr(torch, dtype)), prompt, 1.0, top_p)
    counts = {}
    for r in out.response_ids:
        counts[tuple(r)] = counts.get(tuple(r), 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    # E[TV] <= 0.5 * sum sqrt(p(1-p)/n); McDiarmid adds sqrt(ln(1/delta) / 2n) with delta = 1e-4.
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values()) + math.sqrt(math.log(1e4) / (2 * n))
    assert tv < bound, (tv, bound)
    drafted, accepted = sum(out.drafted), sum(out.accepted)
    assert 0 < accepted < drafted  # drafts were proposed, some accepted, some rejected


def test_tuner_in_the_loop_records_strategies(model):
    tuner = StrategyTuner(buckets=[1, 2, 5, 21], epsilon=0.2, seed=0)
    eng = _engine(model, tuner=tuner)
    out = eng.generate(_prompts(6, 64, seed=8), spec=True)
    assert out.stats.strategy and sum(len(r) for b in tuner.rewards for r in b) == out.stats.spec_steps


def test_metrics_of_a_speculative_rollout(model):
    """SD from the first decode step (threshold = all 12 rows), so the accept metrics always exist:
    tokens per verify pass = 1 + accepted drafts per pass, within 1 .. depth + 1."""
    out = _engine(model, spec_threshold=12, strategy=CHAIN).generate(_prompts(6, 64, seed=9), group_size=2,
                                                                       temperature=1.0, spec=True)
    m = rollout_metrics(out)
    assert m["rollout/response_length/max"] <= 20 and m["rollout/tokens_per_s"] > 0
    assert 0 <= m["rollout/tail_share"] <= 1 and 0 < m["spec/enabled_share"] <= 1
    s = out.stats
    assert s.spec_steps > 0 and "spec/accept_rate/pos_0" in m
    # every row emitted its prefill token, then only SD rounds: tokens - rows came from SD
    assert s.spec_tokens == sum(map(len, out.response_ids)) - len(out.response_ids)
    assert m["spec/accept_len/mean"] == pytest.approx(s.spec_tokens / s.spec_row_passes)
    assert 1.0 <= m["spec/accept_len/mean"] <= CHAIN.depth + 1
    # truncation at EOS / max_new can only drop accepted tokens: passes + accepted >= tokens
    assert s.spec_tokens <= s.spec_row_passes + sum(out.accepted)
    assert m["spec/accept_rate"] == pytest.approx(sum(out.accepted) / sum(out.drafted))


def test_plain_arm_of_the_tuner_is_lossless_and_tried(model):
    from tlt.rollout.tuner import PLAIN

    prompts = _prompts(6, 64, seed=10)
    ref = _engine(model).generate(prompts, spec=False).response_ids
    tuner = StrategyTuner(arms=[[PLAIN, CHAIN]] * 4, buckets=[1, 2, 5, 21], epsilon=0.5, seed=0)
    out = _engine(model, tuner=tuner).generate(prompts, spec=True)
    assert out.response_ids == ref
    assert out.stats.tuner_plain_steps > 0 and out.stats.spec_steps > 0
    played = sum(len(b[0]) for b in tuner.rewards)  # arm 0 = PLAIN in every bucket
    assert played == out.stats.tuner_plain_steps
    assert PLAIN.plain and not CHAIN.plain
    # both arms were timed in some bucket: its regret is the tuner's, and it reaches the stats
    assert out.stats.regret == tuner.regret_stats() and sum(tuner.regret()) > 0


@pytest.mark.parametrize("patience", [0, 3, 1000])
def test_spec_patience_delays_the_switch(model, patience):
    """SD turns on only after `spec_patience` consecutive steps under the threshold (TLT: 10)."""
    prompts = _prompts(1, 64, seed=11)
    ref = _engine(model).generate(prompts, spec=False).response_ids
    out = _engine(model, strategy=CHAIN, spec_patience=patience, eos=()).generate(prompts, spec=True)
    assert out.response_ids == ref
    assert out.stats.decode_steps == min(patience, 19)  # 20 tokens: 1 from the prefill, then 19 steps
    assert (out.stats.spec_steps > 0) == (patience < 19)


def test_plain_strategy_needs_both_zero():
    with pytest.raises(ValueError, match="both be 0"):
        SpecStrategy(depth=0, topk=1, tokens=4)


def _exact_joint_eos(model, prompt, temperature, n_tokens, eos):
    """Exact probability of every response of at most n_tokens that stops at `eos` (top_p 1)."""
    from tlt.rollout.torch_engine.sampling import target_probs
    live, mass, final = [()], torch.ones(1), {}
    with torch.no_grad():
        for _ in range(n_tokens):
            ids = torch.tensor([prompt + list(s) for s in live])
            p = target_probs(model(input_ids=ids).logits[:, -1], temperature, 1.0)  # [S, V]
            nxt, nmass = [], []
            for i, s in enumerate(live):
                for t in range(p.shape[1]):
                    q = float(mass[i] * p[i, t])
                    if t == eos:
                        final[s + (t,)] = q
                    else:
                        nxt.append(s + (t,))
                        nmass.append(q)
            live, mass = nxt, torch.tensor(nmass)
    final.update({s: float(m) for s, m in zip(live, mass)})
    return final


def _tv_bound(dist: dict, n: int) -> float:
    return 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in dist.values()) + math.sqrt(math.log(1e4) / (2 * n))


def _project(dist: dict, f) -> dict:
    out = {}
    for k, p in dist.items():
        out[f(k)] = out.get(f(k), 0.0) + p
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_chain_with_drafter_q_is_exact(temperature):
    """Chains sampled from the drafter's q and accepted with min(1, p/q) (residual max(0, p - q))
    follow the policy exactly: a reduced draft vocabulary (d2t != 0), EOS inside accepted blocks,
    three positions deep. TV of the (t1, t2) and (t2, t3) marginals within a sample-size bound."""
    model = tiny_model("llama", layers=2, vocab=16, seed=3)
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=8)).eval()
    counts = torch.zeros(16, dtype=torch.long)
    counts[torch.tensor([1, 4, 5, 7, 9, 11, 12, 14])] = 10  # draft ids != target ids: d2t != 0
    drafter.set_vocab(counts)
    assert bool((drafter.d2t != 0).any())
    eos = 9  # inside the draft vocabulary: drafted, and accepted mid-block
    prompt = [5, 6, 7, 5, 6, 8, 5, 6, 9, 3, 5, 6]
    n = 4000
    cfg = RolloutConfig(max_new_tokens=3, temperature=temperature, spec_threshold=n, tuner=False, drafter="eagle",
                        strategy=SpecStrategy(depth=3, topk=1, tokens=3))
    eng = RolloutEngine(model, cfg, eos_ids=[eos], pad_id=0, drafter=drafter)
    out = eng.generate([prompt], group_size=n, temperature=temperature, seed=5, spec=True)
    exact = _exact_joint_eos(model, prompt, temperature, 3, eos)
    emp = {}
    for r in out.response_ids:
        emp[tuple(r)] = emp.get(tuple(r), 0) + 1 / n
    assert any(r[-1] == eos and len(r) < 3 for r in out.response_ids)
    for f in (lambda s: s[:2], lambda s: s[1:3]):
        ex, em = _project(exact, f), _project(emp, f)
        tv = 0.5 * sum(abs(em.get(k, 0) - p) for k, p in ex.items())
        assert tv < _tv_bound(ex, n), (tv, _tv_bound(ex, n))
    acc_pos = out.stats.accepted_pos
    assert len(acc_pos) == 3 and acc_pos[2] > 0  # some rounds accepted all three drafts
    assert 0 < sum(out.accepted) < sum(out.drafted)


def test_chain_acceptance_rate_is_one_minus_tv():
    """One draft x ~ q: the q rule accepts with rate sum(min(p, q)) = 1 - TV(p, q), above the point-mass
    rate sum(q * p) when q is close to p; the bonus after a rejection follows norm(max(0, p - q))."""
    from tlt.rollout.torch_engine.draft import DraftTree
    from tlt.rollout.torch_engine.spec import accept_chain_sampled
    from tlt.rollout.torch_engine.sampling import draw, reject_siblings

    g = torch.Generator().manual_seed(0)
    V, B = 6, 200_000
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.05, 0.05])
    logits = torch.log(p).expand(B, 2, V).clone()  # root + 1 draft; T = 1
    x = draw(q.expand(B, V), g)
    tree = DraftTree(x[:, None], torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                     torch.ones(B, 1, dtype=torch.bool))
    _, n_acc, bonus = accept_chain_sampled(logits, tree, q.expand(B, 1, V), torch.arange(V), 1.0, 1.0, g)
    rate = n_acc.float().mean().item()
    assert abs(rate - torch.minimum(p, q).sum().item()) < 0.005
    point, _, _ = reject_siblings(p.expand(B, V), x[:, None], torch.ones(B, 1, dtype=torch.bool), g)
    assert abs(point.float().mean().item() - (p * q).sum().item()) < 0.005
    assert rate > point.float().mean().item() + 0.3
    out = torch.where(n_acc > 0, x, bonus)  # the emitted first token
    emp = torch.bincount(out, minlength=V).float() / B
    assert (emp - p).abs().max() < 0.005


def test_calibrator_learns_acceptance_per_depth_and_bin():
    from tlt.rollout.torch_engine.calibrate import Calibrator

    c = Calibrator(max_depth=4, bins=10)
    assert c.acceptance(0, torch.tensor([0.95])).item() == pytest.approx(0.95)  # prior: the raw probability
    prob = torch.full((1000, 2), 0.95)
    n_acc = torch.zeros(1000, dtype=torch.long)  # a drafter that is always wrong at depth 0
    c.update(prob, torch.ones(1000, 2, dtype=torch.bool), n_acc)
    assert c.acceptance(0, torch.tensor([0.95])).item() < 0.01
    assert c.acceptance(1, torch.tensor([0.95])).item() == pytest.approx(0.95)  # depth 1 never observed


def test_calibrated_early_stop_is_lossless_and_drafts_less():
    """A chain that stops where the calibrated chance of use is low: greedy output unchanged,
    fewer drafts verified than the full-depth chain with the same (random) drafter."""
    model = tiny_model("llama", layers=2, vocab=64, seed=1)
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=0)).eval()
    prompts = _prompts(6, 64, seed=4)
    base = dict(max_new_tokens=16, temperature=0.0, spec_threshold=100, tuner=False, drafter="eagle",
                strategy=SpecStrategy(depth=4, topk=1, tokens=4))
    plain = RolloutEngine(model, RolloutConfig(**base), eos_ids=[2], pad_id=0).generate(prompts, spec=False)
    full = RolloutEngine(model, RolloutConfig(**base), eos_ids=[2], pad_id=0, drafter=drafter)
    stop = RolloutEngine(model, RolloutConfig(**base, draft_stop_below=0.3), eos_ids=[2], pad_id=0, drafter=drafter)
    a, b = full.generate(prompts, spec=True), stop.generate(prompts, spec=True)
    assert a.response_ids == b.response_ids == plain.response_ids
    assert sum(b.drafted) < sum(a.drafted)
    assert stop.calibrator.n[0].sum() > full.calibrator.n[0].sum()  # it learned from verification


def test_point_mass_chains_stay_exact():
    """rollout.sampled_drafts=false (argmax drafts, accepted with p(x)): still the policy's distribution."""
    model = tiny_model("llama", layers=2, vocab=16, seed=3)
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=0)).eval()
    prompt = [5, 6, 7, 5, 6, 8, 5, 6, 9, 3, 5, 6]
    n = 3000
    cfg = RolloutConfig(max_new_tokens=2, temperature=1.0, spec_threshold=n, tuner=False, drafter="eagle",
                        strategy=SpecStrategy(depth=2, topk=1, tokens=2), sampled_drafts=False)
    out = RolloutEngine(model, cfg, eos_ids=[], pad_id=0, drafter=drafter).generate([prompt], group_size=n, seed=2,
                                                                                   spec=True)
    exact = _exact_joint(model, prompt, 1.0, 1.0)
    counts = {}
    for r in out.response_ids:
        counts[tuple(r)] = counts.get(tuple(r), 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    assert tv < _tv_bound(exact, n)
    assert 0 < sum(out.accepted) < sum(out.drafted)
