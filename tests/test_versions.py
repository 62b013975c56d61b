"""Weight versions (tlt.versions): every write site bumps the policy's or the drafter's
version, and the torch engine syncs its rollout-dtype copies exactly when a version moved."""
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tlt import retrain
from tlt.config import DrafterConfig, RLConfig, RolloutConfig, TrainerConfig
from tlt.drafter.model import build_drafter
from tlt.drafter.refresh import DrafterRefresher
from tlt.drafter.train import DrafterTrainer
from tlt.models import tiny_model
from tlt.rl.logprobs import forward_logprobs, make_batch
from tlt.rl.resume import restore_run_state, save_run_state, steps_done
from tlt.rl.update import DeepSpeedUpdater, PolicyBatch, TorchUpdater
from tlt.rollout import RolloutEngine
from tlt.versions import Synced, bump, version_of

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11]]
RESPONSES = [[20, 21, 22], [23, 24, 25, 26, 27], [28], [29, 30]]
DCFG = DrafterConfig(draft_vocab_size=0, schedule="every_k", batch_tokens=256, refresh_steps=2)


@pytest.fixture(autouse=True)
def _no_jit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))


def _model(seed=0):
    return tiny_model(layers=2, hidden=128, vocab=64, seed=seed)


def _batch(model) -> PolicyBatch:
    ids, attn, resp, pos = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        old = forward_logprobs(model, ids, attn, resp, position_ids=pos).logp
    return PolicyBatch(ids, attn, resp, old, torch.tensor([1.0, -1.0, 0.5, -0.5]), position_ids=pos)


def _refresher(model) -> DrafterRefresher:
    torch.manual_seed(0)
    drafter = build_drafter(model, DCFG)
    refresher = DrafterRefresher(DrafterTrainer(drafter, DCFG, model.get_output_embeddings().weight), DCFG)
    ids, attn, resp, pos = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        fo = forward_logprobs(model, ids, attn, resp, aux_layer_ids=drafter.aux_layer_ids, position_ids=pos)
    refresher.add_rollouts(0, ids, attn, resp, fo.aux, fo.last_hidden)
    return refresher


def test_bump_and_synced():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert version_of(a) == 0 and version_of(None) == 0 and bump(a) == 1 and version_of(a) == 1
    seen = Synced(policy=a, drafter=None)
    assert seen.moved(policy=a, drafter=None) == set()
    with torch.no_grad():
        a.weight.add_(1.0)  # a write without a bump is not looked for: no content scan
    assert seen.moved(policy=a, drafter=None) == set()
    bump(a)
    assert seen.moved(policy=a, drafter=None) == {"policy"}
    assert seen.moved(policy=b) == {"policy"}  # another module under the same name
    assert seen.moved(other=a) == {"other"}  # never taken
    seen.take(policy=a)
    assert seen.moved(policy=a) == set() and seen.version("policy") == 2


def test_torch_update_bumps_the_policy():
    model = _model()
    TorchUpdater(model, RLConfig(lr=1e-3), TrainerConfig(micro_batch_size=2)).step(_batch(model))
    assert version_of(model) == 1


def test_deepspeed_zero2_update_bumps_the_policy():
    """ZeRO-2 writes through its flat buffers (torch's tensor version counters stay put): the
    updater's own bump is what the engines see."""
    model = _model()
    counters = [p._version for p in model.parameters()]
    upd = DeepSpeedUpdater(model, RLConfig(lr=1e-3), TrainerConfig(backend="deepspeed", zero_stage=2))
    try:
        upd.step(_batch(model))
    finally:
        upd.close()
    assert version_of(model) == 1
    assert [p._version for p in model.parameters()] == counters


def test_drafter_training_and_refresh_bump_the_drafter():
    model = _model()
    refresher = _refresher(model)
    refresher.refresh(0)
    assert version_of(refresher.drafter) == 2  # one bump per drafter step (refresh_steps: 2)
    counts = torch.zeros(model.config.vocab_size)
    refresher.drafter.set_vocab(counts)
    assert version_of(refresher.drafter) == 3


def test_resume_bumps_policy_and_drafter(tmp_path):
    model = _model()
    refresher = _refresher(model)
    sampler = SimpleNamespace(state=lambda: {}, load_state=lambda s: None)
    ctx = SimpleNamespace(model=model, updater=TorchUpdater(model, RLConfig(), TrainerConfig()), sampler=sampler,
                          engine=SimpleNamespace(state_dict=dict, load_state_dict=lambda s: None), refresher=refresher)
    save_run_state(ctx, 0, tmp_path, keep=1)
    assert version_of(model) == version_of(refresher.drafter) == 0
    assert steps_done(restore_run_state(ctx, tmp_path)) == 1  # folder step-000001: one RL step done
    assert version_of(model) == 1 and version_of(refresher.drafter) == 1


def test_champion_loads_bump(tmp_path, monkeypatch):
    model, drafter = _model(), build_drafter(_model(), DCFG)
    save_file({k: v.contiguous() for k, v in _model(seed=3).state_dict().items()}, tmp_path / "policy.safetensors")
    (tmp_path / "d").mkdir()
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, tmp_path / "d" / "model.safetensors")
    monkeypatch.setattr(retrain, "champion", lambda *a: {"version": "1", "source": "x"})
    monkeypatch.setattr(retrain, "champion_policy", lambda *a: tmp_path / "policy.safetensors")
    monkeypatch.setattr(retrain, "download", lambda *a: tmp_path / "d")
    cfg = SimpleNamespace(export=SimpleNamespace(model_name="m"), tracking=SimpleNamespace(tracking_uri=""),
                          deploy=SimpleNamespace(on_missing_champion_policy="fail"))
    found = retrain.load_champion_policy(model, cfg, SimpleNamespace(set_tags=lambda tags: None), tmp_path / "dl")
    retrain.load_champion_drafter(drafter, found, cfg, tmp_path)
    assert version_of(model) == 1 and version_of(drafter) == 1


def _copy_engine(model, drafter=None):
    cfg = RolloutConfig(dtype="bfloat16", max_new_tokens=6, temperature=0.0, tuner=False, spec_threshold=100,
                        drafter="eagle")
    return RolloutEngine(model, cfg, [2], 0, drafter=drafter)


def test_engine_copies_exactly_when_the_version_moved(monkeypatch):
    """A generate with no bump copies nothing (a write without a bump stays unseen: nothing scans
    the weights); after a bump the next generate decodes with the new weights."""
    model = _model()
    engine = _copy_engine(model)
    copies = []
    real = engine.copy.module.state_dict
    monkeypatch.setattr(engine.copy.module, "state_dict", lambda *a, **k: copies.append(1) or real(*a, **k))
    before = engine.generate([[1, 5, 9]], spec=False).response_ids
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    assert engine.generate([[1, 5, 9]], spec=False).response_ids == before and copies == []
    bump(model)
    after = engine.generate([[1, 5, 9]], spec=False).response_ids
    assert copies == [1] and after != before
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    assert engine.sync(model) == {"rollout/weights_copied": 0.0}


def test_engine_after_an_update_decodes_like_a_fresh_engine():
    """Policy update and drafter refresh, then greedy SD: the same tokens and the same accepted drafts
    as an engine built on those weights."""
    model = _model()
    refresher = _refresher(model)
    engine = _copy_engine(model, refresher.drafter)
    prompts = [[1, 5, 9], [1, 7, 7, 3], [1, 30]]
    engine.generate(prompts, spec=True)
    TorchUpdater(model, RLConfig(lr=1e-2), TrainerConfig()).step(_batch(model))
    refresher.refresh(0)
    got = engine.generate(prompts, spec=True)
    want = _copy_engine(model, refresher.drafter).generate(prompts, spec=True)
    assert got.response_ids == want.response_ids and got.accepted == want.accepted and got.drafted == want.drafted


def test_pipeline_load_weights_bumps(tmp_path):
    """Evaluation from a run checkpoint (`Pipeline.load_weights`): policy and drafter versions move."""
    from tlt.checkpoint import save_checkpoint
    from tlt.pipeline import Pipeline

    model = _model()
    drafter = build_drafter(model, DCFG)
    path = save_checkpoint(tmp_path, 4, {"policy": _model(seed=5).state_dict(), "drafter": drafter.state_dict()},
                           {"step": 4})
    pipe = SimpleNamespace(model=model, drafter=drafter, cfg=SimpleNamespace(drafter=DCFG))
    assert Pipeline.load_weights(pipe, path) == 5
    assert version_of(model) == 1 and version_of(drafter) == 1
