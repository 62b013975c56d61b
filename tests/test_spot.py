"""Spot trainer: trains in a worker process between start (tail) and finish (rollout end)."""
import time

import pytest
import torch

from tlt.config import DrafterConfig
from tlt.drafter.model import build_drafter
from tlt.drafter.spot import SpotTrainer
from tlt.drafter.train import DrafterTrainer
from tlt.models import tiny_model
from tlt.drafter.schedule import RefreshSchedule
from tlt.rl.logprobs import forward_logprobs, make_batch
from tlt.versions import bump, version_of
from test_schedule import CASES, steps_trained


def add_rollouts(spot, target, responses: list[list[int]]) -> None:
    """Two prompts' responses through the old-log-prob forward into the spot trainer's buffer."""
    ids, attn, resp, pos = make_batch([[1, 5, 6, 7], [1, 8, 9]], responses, 0)
    with torch.no_grad():
        fo = forward_logprobs(target, ids, attn, resp, aux_layer_ids=spot.aux_layer_ids, position_ids=pos)
    spot.add_rollouts(0, ids, attn, resp, fo.aux, fo.last_hidden)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_model("llama", layers=6, hidden=128, vocab=256)
    # the pre-EAGLE-3 recipe (1 step, feature loss): a few seconds of worker time fit it visibly
    cfg = DrafterConfig(draft_vocab_size=0, schedule="every_k", batch_tokens=256, lr=1e-3, refresh_lr=1e-3, ttt_steps=1,
                        loss_feature_weight=1.0, loss_token_weight=0.1)
    drafter = build_drafter(target, cfg)
    spot = SpotTrainer(target, drafter, cfg, threads=1)
    add_rollouts(spot, target, [list(range(20, 44)), list(range(50, 70))])
    yield target, drafter, spot
    spot.close()


def test_no_training_without_data_or_start(setup):
    _, _, spot = setup
    assert spot.finish()["drafter/spot_steps"] == 0.0  # never started: nothing to stop


def test_spot_trainer_is_a_refresher_whose_tail_hook_starts_it(setup):
    from tlt.rl.protocols import Refresher

    _, _, spot = setup
    assert isinstance(spot, Refresher)
    assert spot.before_rollout(0) == spot.start  # the rollout's on_tail; sync_policy ran
    assert spot.after_rollout()["drafter/spot_steps"] == 0.0  # the hook was never called


@pytest.mark.parametrize("case", list(CASES))
def test_the_schedule_decides_which_tails_train(setup, case):
    """drafter.schedule means the same under the spot trainer as under the sequential refresher
    (test_schedule.py): counted per tail; below_accept trains in the tail after the low rollout."""
    _, _, spot = setup
    keys, accepts, want, _ = CASES[case]
    cfg, sched = spot.cfg, spot.schedule
    spot.cfg = cfg.model_copy(update=keys)
    spot.schedule = RefreshSchedule(spot.cfg)
    try:
        assert steps_trained(spot, accepts) == want
    finally:
        spot.cfg, spot.schedule = cfg, sched


def test_trains_until_finish_and_loads_weights(setup):
    _, drafter, spot = setup
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    version = version_of(drafter)
    spot.start(1)
    time.sleep(3.0)  # the "tail": the worker trains meanwhile
    m = spot.finish()
    assert version_of(drafter) == version + 1  # one load of the tail's weights: the engines sync once
    assert m["drafter/spot_steps"] >= 1 and m["drafter/loss"] > 0
    changed = [k for k, v in drafter.state_dict().items() if not torch.equal(v, before[k])]
    assert "fc.weight" in changed and "midlayer.mlp.down_proj.weight" in changed
    assert not any("embed" in k for k in drafter.state_dict())  # frozen embedding never moves
    assert torch.equal(drafter.embed_weight, setup[0].get_input_embeddings().weight)


def test_a_tail_shorter_than_one_step_still_trains_one(setup):
    """finish() right after start(): the stop flag is set before the worker's first step, which
    still runs, so every rollout with a tail refreshes the drafter (and stops after that step)."""
    _, drafter, spot = setup
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    spot.start(1)
    m = spot.finish()
    assert m["drafter/spot_steps"] >= 1
    assert any(not torch.equal(v, before[k]) for k, v in drafter.state_dict().items())


def test_loaded_weights_lower_the_loss(setup):
    """The weights that come back from the worker fit the buffer better than a fresh drafter."""
    target, drafter, spot = setup
    fresh = build_drafter(target, spot.cfg)
    batch = spot.buffer.batches(spot.cfg.batch_tokens, None)[0]
    head = target.get_output_embeddings().weight
    with torch.no_grad():
        trained_loss, _ = DrafterTrainer(drafter, spot.cfg, head).compute_loss(batch)
        fresh_loss, _ = DrafterTrainer(fresh, spot.cfg, head).compute_loss(batch)
    assert float(trained_loss) < 0.8 * float(fresh_loss)


def test_policy_sync_through_shared_memory(setup):
    target, _, spot = setup
    with torch.no_grad():
        target.get_input_embeddings().weight.add_(0.5)
    spot.sync_policy()
    assert not torch.equal(spot._embed, target.get_input_embeddings().weight)  # no new version: no copy
    bump(target)  # as an update does
    spot.sync_policy()
    assert torch.equal(spot._embed, target.get_input_embeddings().weight)
    with torch.no_grad():
        target.get_input_embeddings().weight.sub_(0.5)
    bump(target)
    spot.sync_policy()


def test_optimizer_state_round_trip(setup):
    _, drafter, spot = setup
    opt = spot.optimizer_state()
    assert opt["num_steps"] >= 1 and opt["optimizer"]["state"]
    spot.load(drafter.state_dict(), opt)
    assert spot.optimizer_state()["num_steps"] == opt["num_steps"]
