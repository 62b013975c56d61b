"""Spec guard (tlt.rollout.guard): the drafter probe check, and the run-time switch-off of SD per
batch-size tier below break-even, on the torch engine with a deliberately useless drafter."""
import copy

import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig, SpecStrategy
from tlt.drafter.model import build_drafter
from tlt.metrics import rollout_metrics
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine
from tlt.rollout.guard import DrafterMismatch, SpecGuard, StepLog, check_probe, probe_inputs, probe_logits
from tlt.versions import bump, write_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def _log(accept: float, round_s: float, plain_s: float = 1.0, tier: int = 0) -> StepLog:
    log = StepLog()
    log.plain(plain_s)
    log.spec(tier, round_s, 10, int(accept * 10))
    return log


def test_guard_trips_after_patience_and_rearms():
    g = SpecGuard([1, 2, 5], patience=2)
    assert g.observe(_log(accept=1.2, round_s=1.5)) == 0  # 1 rollout below break-even 1.5
    assert g.observe(_log(accept=2.0, round_s=1.5)) == 0  # above: the count starts over
    assert g.observe(_log(accept=1.2, round_s=1.5)) == 0
    with pytest.warns(UserWarning, match="batch sizes 1-1 accepted 1.20"):
        assert g.observe(_log(accept=1.2, round_s=1.5)) == 1
    assert not g.allows(1) and g.allows(2) and g.allows(7)
    g.rearm()
    assert g.allows(1) and g.tripped == 0
    assert g.observe(StepLog()) == 0  # no plain step to price rounds against: no verdict


def test_guard_off_with_patience_zero():
    g = SpecGuard([1], patience=0)
    for _ in range(5):
        assert g.observe(_log(accept=1.0, round_s=3.0)) == 0


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=2, vocab=64, seed=1)


def _useless_drafter(target):
    torch.manual_seed(0)
    drafter = build_drafter(target, DrafterConfig(draft_vocab_size=64))
    with torch.no_grad():
        drafter.lm_head.weight.zero_()  # every draft is draft slot 0: almost never the target's token
    return drafter.eval()


def test_probe_matches_itself_and_catches_a_changed_drafter(target):
    drafter = _useless_drafter(target)
    torch.nn.init.normal_(drafter.lm_head.weight, std=0.05)
    probe = probe_inputs(drafter)
    ref = probe_logits(drafter, probe)
    assert check_probe(ref, probe_logits(copy.deepcopy(drafter), probe), "float32", "copy")["spec/probe_error"] == 0
    stale = copy.deepcopy(drafter)
    with torch.no_grad():
        stale.midlayer.mlp.down_proj.weight.mul_(0.5)
    with pytest.raises(DrafterMismatch, match="not the one just exported"):
        check_probe(ref, probe_logits(stale, probe), "float32", "test")


def test_useless_drafter_trips_the_guard_on_the_torch_engine(target):
    """patience 3 gives every rollout plain steps to price an SD round against (same batch size)."""
    drafter = _useless_drafter(target)
    cfg = RolloutConfig(max_new_tokens=24, temperature=0.0, spec_threshold=100, spec_patience=3, tuner=False,
                        drafter="eagle", strategy=SpecStrategy(depth=3, topk=1, tokens=3), guard_patience=2)
    eng = RolloutEngine(target, cfg, eos_ids=[], pad_id=0, drafter=drafter)
    prompts = [[5, 6, 7], [9, 3, 4, 8], [11, 12], [20, 21, 22, 23, 24]]
    outs = [eng.generate(prompts) for _ in range(2)]
    assert all(o.stats.spec_row_passes > 0 and o.stats.accept_len < 1.2 for o in outs)
    assert [rollout_metrics(o)["spec/guard_tripped"] for o in outs] == [0.0, 1.0]
    off = eng.generate(prompts)  # the tier of batch size 4 decodes without SD now, same tokens
    assert off.stats.spec_row_passes == 0 and off.response_ids == outs[0].response_ids
    assert rollout_metrics(off)["spec/guard_tripped"] == 1.0
    write_weights(drafter, {"lm_head.weight": target.lm_head.weight}, strict=False)  # a new drafter: the guard re-arms
    again = eng.generate(prompts)
    assert again.stats.spec_row_passes > 0 and again.response_ids == outs[0].response_ids


def test_torch_engine_probes_its_drafter_copy(target, monkeypatch):
    """rollout.dtype bfloat16: the engine drafts with a bf16 copy of the fp32 drafter; the copy passes
    the probe at start and after a refresh, and a refresh that lost a weight raises."""
    from tlt.rollout.torch_engine import weights

    drafter = _useless_drafter(target)
    torch.nn.init.normal_(drafter.lm_head.weight, std=0.05)
    cfg = RolloutConfig(max_new_tokens=4, temperature=0.0, spec_threshold=100, tuner=False, drafter="eagle",
                        dtype="bfloat16", strategy=SpecStrategy(depth=2, topk=1, tokens=2))
    eng = RolloutEngine(target, cfg, eos_ids=[], pad_id=0, drafter=drafter)
    assert eng.drafter is not drafter and 0 < eng.probe_metrics["spec/probe_error"] < 5e-2
    with torch.no_grad():
        drafter.midlayer.mlp.down_proj.weight.mul_(1.5)  # a refresh
    bump(drafter)
    eng.generate([[5, 6, 7]])
    assert 0 < eng.probe_metrics["spec/probe_error"] < 5e-2
    real = weights.RolloutCopy.refresh

    def lossy(self, master):  # rounds everything but the MLP's down projection into the copy
        changed = real(self, master)
        if master is drafter:  # (the policy's copy refreshes through here too)
            with torch.no_grad():
                self.module.midlayer.mlp.down_proj.weight.zero_()
        return changed

    monkeypatch.setattr(weights.RolloutCopy, "refresh", lossy)
    with torch.no_grad():
        drafter.lm_head.weight.add_(0.01)
    bump(drafter)
    with pytest.raises(DrafterMismatch, match="torch engine's drafter copy"):
        eng.generate([[5, 6, 7]])
