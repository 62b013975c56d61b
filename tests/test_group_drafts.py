"""Drafts from the group's own rollouts: n-gram lookup over the other samples of a GRPO group and
the prompt's earlier responses, chosen per round next to the trained drafter; always lossless."""
import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig, SpecStrategy
from tlt.drafter.model import build_drafter
from tlt.metrics import rollout_metrics
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine, StrategyTuner
from tlt.rollout.acceptance import measure_accept
from tlt.rollout.torch_engine.ngram import NgramDrafter, PromptHistory
from tlt.rollout.torch_engine.spec import spec_round
from tlt.rollout.torch_engine.state import Outputs

NGRAM4 = SpecStrategy(depth=4, topk=1, tokens=4, source="ngram")
EAGLE3 = SpecStrategy(depth=3, topk=1, tokens=3)

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(n, vocab, seed, lo=3, hi=14):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, vocab=64, seed=1)


def _engine(model, drafter=None, tuner=None, **kw):
    base = dict(max_new_tokens=24, temperature=0.0, spec_threshold=100, tuner=False, strategy=NGRAM4,
                drafter="eagle" if drafter is not None else "ngram")
    base.update(kw)
    return RolloutEngine(model, RolloutConfig(**base), eos_ids=[2], pad_id=0, drafter=drafter, tuner=tuner)


# ---- the lookup ----------------------------------------------------------------------------
def test_lookup_continues_from_a_reference():
    ng = NgramDrafter(max_n=3)
    seq = [9, 1, 2, 3]
    assert ng.continuations(seq, 4, 1) == []  # nothing earlier in the sequence itself
    assert ng.continuations(seq, 4, 1, refs=[[7, 1, 2, 3, 4, 5, 6, 8]]) == [[4, 5, 6, 8]]


def test_lookup_prefers_longer_matches_and_never_crosses_references():
    ng = NgramDrafter(max_n=3)
    refs = [[5, 3, 11, 12], [1, 2, 3]]  # "1 2 3" ends a reference: its continuation would be the next ref
    assert ng.continuations([1, 2, 3], 4, 2, refs=refs) == [[11, 12]]  # only the 1-gram "3" in ref 0 continues
    refs = [[2, 3, 21, 22], [1, 2, 3, 31]]
    assert ng.continuations([1, 2, 3], 2, 2, refs=refs) == [[31], [21, 22]]  # 3-gram match before the 2-gram


def test_prompt_history_keeps_the_newest():
    h = PromptHistory(per_prompt=2, max_prompts=2)
    for r in ([1], [2], [3]):
        h.add([7], r)
    assert [a.tolist() for a in h.get([7])] == [[2], [3]]
    h.add([8], [4])
    h.get([7])  # 7 becomes the most recently used
    h.add([9], [5])
    assert len(h) == 2 and h.get([8]) == [] and h.get([7])
    PromptHistory(per_prompt=0).add([1], [2])  # off: nothing kept, no error


# ---- in the engine ------------------------------------------------------------------------
def test_earlier_rollouts_of_a_prompt_are_drafts(model):
    """A greedy rerun of the same prompts drafts the whole earlier answer: near depth + 1 tokens per
    verify, outputs identical to plain decoding; with group_drafts off the history is not used."""
    prompts = _prompts(4, 64, seed=3)
    plain = _engine(model).generate(prompts, spec=False).response_ids
    eng = _engine(model)
    first = measure_accept(eng, prompts, max_new_tokens=24, strategy=NGRAM4)  # history swapped out: no help
    eng.generate(prompts, spec=False)  # fills the history
    again = eng.generate(prompts, spec=True)
    assert again.response_ids == plain == first.responses
    m = rollout_metrics(again)
    assert m["spec/accept_len/mean"] > 3.5 > first.accept_len
    assert m["spec/ngram_share"] == 1.0 and m["spec/ngram_accept_len"] == m["spec/accept_len/mean"]
    off = _engine(model, group_drafts=False)
    off.generate(prompts, spec=False)
    assert len(off.history) == 0
    assert rollout_metrics(off.generate(prompts, spec=True))["spec/accept_len/mean"] < 3.5


def test_every_member_of_a_group_is_kept_for_later_rollouts(model):
    prompt = _prompts(1, 64, seed=5)
    eng = _engine(model, temperature=1.0)
    out = eng.generate(prompt, group_size=4, spec=True, seed=2)
    assert [h.tolist() for h in eng.history.get(prompt[0])] == out.response_ids


def test_group_references_reach_the_lookup(model):
    """spec_round's n-gram drafts for a row come from the other rows of its group: with one member
    already finished, the others draft its continuation and accept it (greedy, identical answers)."""
    prompt = _prompts(1, 64, seed=11)
    eng = _engine(model)
    full = eng.generate(prompt, spec=False).response_ids[0]
    assert len(full) >= 6 and full[0] not in prompt[0]  # the lookup's only match is in the other member
    eng.history = PromptHistory(0)  # no earlier answers: only the group may help
    outs = Outputs.empty(2, 24, eng.device)
    outs.group_size = 2
    opts = dict(max_new=24, temperature=0.0, top_p=1.0)
    gen = torch.Generator().manual_seed(0)
    st = eng._prefill(prompt, 2, opts, gen, outs, keep_aux=False)
    # Member 1 finished: its whole answer is in the buffers; member 0 is at its first token.
    outs.tok[1, : len(full)] = torch.tensor(full)
    outs.n[1] = len(full)
    outs.done[1] = True
    eng._retire(st, outs)
    assert st.rows.tolist() == [0]
    produced = spec_round(eng.round_parts(), st, NGRAM4, opts, gen, outs)
    assert produced == 5 and outs.tok[0, :5].tolist() == full[:5]
    assert outs.stats.ngram_tokens == 5


class _Alternate:
    """A tuner stand-in that alternates two strategies (drafter, n-gram) round by round."""

    def __init__(self, arms):
        self.arms, self.i = arms, 0

    def choose(self, batch_size):
        self.i += 1
        return self.arms[self.i % len(self.arms)]

    def update(self, *a, **kw):
        pass

    def regret_stats(self):
        return {}

    def bucket_of(self, batch_size):
        return 0

    def arm_index(self, batch_size, arm):
        return self.arms.index(arm)


def test_mixed_rounds_keep_the_drafter_fed_and_are_lossless(model):
    """EAGLE and n-gram rounds interleaved: greedy output identical to plain, and the drafter has
    seen every committed position exactly once (its cache + pending inputs = positions 0..pos-1)."""
    dr = build_drafter(model, DrafterConfig(draft_vocab_size=0)).eval()
    prompts = _prompts(3, 64, seed=13)
    plain = _engine(model).generate(prompts, spec=False).response_ids
    eng = _engine(model, drafter=dr, tuner=_Alternate([EAGLE3, NGRAM4]))
    eng.generate(prompts, spec=False)  # history: n-gram rounds accept several tokens
    assert eng.generate(prompts, spec=True).response_ids == plain
    outs = Outputs.empty(3, 24, eng.device)
    opts = dict(max_new=24, temperature=0.0, top_p=1.0)
    gen = torch.Generator().manual_seed(0)
    st = eng._prefill(prompts, 1, opts, gen, outs, keep_aux=True)
    for k in range(4):
        spec_round(eng.round_parts(), st, [EAGLE3, NGRAM4][k % 2], opts, gen, outs)
        fed = (st.dvalid.sum(1) if st.dvalid is not None else 0) + st.pending[3].sum(1)
        assert fed.tolist() == st.pos.tolist()
    assert outs.stats.ngram_row_passes > 0


def test_sampled_group_rollout_with_the_default_bandit(model):
    """The default bandit with n-gram arms in every bucket, sampled, grouped: runs, tries the n-gram
    arms, emits the requested shapes; the round counters add up."""
    r = RolloutConfig(max_new_tokens=24, temperature=1.0, spec_threshold=100, drafter="eagle")
    tuner = StrategyTuner.from_config(r)
    assert any(a.source == "ngram" for a in tuner.arms[0]) and tuner.arms[0][-1].plain
    dr = build_drafter(model, DrafterConfig(draft_vocab_size=0)).eval()
    eng = RolloutEngine(model, r, eos_ids=[2], pad_id=0, drafter=dr, tuner=tuner)
    out = eng.generate(_prompts(2, 64, seed=17), group_size=4, seed=1)
    assert len(out.response_ids) == 8 and all(1 <= len(x) <= 24 for x in out.response_ids)
    s = out.stats
    assert 0 < s.ngram_row_passes <= s.spec_row_passes and s.ngram_tokens <= s.spec_tokens
    tried = {a.name for b, arms in enumerate(tuner.arms) for a, w in zip(arms, tuner.rewards[b]) if w}
    assert any(n.startswith("ngram-") for n in tried)


def test_tuner_state_round_trips_with_sources():
    r = RolloutConfig()
    t = StrategyTuner.from_config(r, seed=3)
    ng = next(a for a in t.arms[0] if a.source == "ngram")
    t.update(1, ng, 5.0)
    u = StrategyTuner.from_config(r)
    u.load_state(t.state())
    assert u.arms == t.arms and u.values(0) == t.values(0)
    assert ng.name == "ngram-chain4" and SpecStrategy(depth=6, topk=2, tokens=8, source="ngram").name == "ngram-tree6x2t8"
