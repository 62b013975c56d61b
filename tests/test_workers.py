"""Rollout worker processes: sharded GRPO groups over shared-memory weights, merged in order."""
import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig, SpecStrategy
from tlt.drafter.model import build_drafter
from tlt.metrics import rollout_metrics
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine
from tlt.versions import bump, write_weights
from tlt.rollout.workers import WorkerPool, merge_batches, shard_sizes

PROMPTS = [[1, 5, 9, 13], [1, 7, 7], [1, 20, 21, 22, 23], [1, 30], [1, 4, 4, 4, 4, 4], [1, 60, 2 + 1]]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = tiny_model("llama", layers=4, hidden=128, vocab=256, seed=3)
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=0))
    cfg = RolloutConfig(max_new_tokens=16, temperature=0.0, spec_threshold=100, tuner=False,
                        strategy=SpecStrategy(depth=3, topk=1, tokens=3))
    local = RolloutEngine(model, cfg, eos_ids=[2], pad_id=0, drafter=drafter)
    pool = WorkerPool(model, cfg, [2], 0, n_workers=2, drafter=drafter, threads=1)
    yield model, drafter, local, pool
    pool.close()


def test_shard_sizes():
    assert shard_sizes(6, 2) == [3, 3] and shard_sizes(7, 3) == [3, 2, 2] and shard_sizes(1, 4) == [1]


def test_greedy_outputs_equal_one_engine_in_group_major_order(setup):
    _, _, local, pool = setup
    ref = local.generate(PROMPTS, group_size=2, spec=True)
    tails = []
    out = pool.generate(PROMPTS, group_size=2, spec=True, on_tail=tails.append)
    assert out.response_ids == ref.response_ids
    assert out.group_index == ref.group_index == [i // 2 for i in range(12)]
    assert out.prompt_ids == ref.prompt_ids
    assert tails == [1]  # the first worker to finish freed its cores while the other decoded on
    m = rollout_metrics(out)
    # one worker finished first (tails == [1]) and waited for the other: idle time, at most one worker's wall-clock
    assert out.stats.workers == 2 and 0.0 < m["rollout/worker_idle_s"] <= out.stats.time_s
    assert out.stats.spec_steps > 0 and sum(out.accepted) <= sum(out.drafted)
    assert out.stats.tokens == sum(map(len, out.response_ids))


def test_policy_updates_reach_workers_without_copy_or_disk(setup):
    model, _, local, pool = setup
    w = model.model.layers[1].mlp.down_proj.weight
    before = pool.generate(PROMPTS, spec=False).response_ids
    with torch.no_grad():
        saved = w.clone()
        w.add_(torch.randn_like(w) * 0.5)  # an optimizer's in-place update
    bump(model)
    assert pool.sync()["rollout/sync_tensors_copied"] == 0  # in place: nothing to copy
    assert pool._policy["model.layers.1.mlp.down_proj.weight"].data_ptr() == w.data_ptr()
    after = pool.generate(PROMPTS, spec=False).response_ids
    assert after == local.generate(PROMPTS, spec=False).response_ids and after != before
    write_weights(model, {"model.layers.1.mlp.down_proj.weight": saved}, strict=False)
    pool.sync()  # taken: the next test starts from no moved version


def test_rebound_parameters_are_copied_by_sync(setup):
    """A backend that swaps parameter storage (DeepSpeed's flat buffers): sync copies it over once
    the version moved, and only then (no scan of the weights while the version stands)."""
    model, _, local, pool = setup
    lin = model.model.layers[2].self_attn.o_proj
    old = lin.weight
    lin.weight = torch.nn.Parameter(old.detach() * 1.5)
    try:
        assert pool.sync(model)["rollout/sync_tensors_copied"] == 0
        bump(model)
        assert pool.sync(model)["rollout/sync_tensors_copied"] == 1
        assert pool.sync(model)["rollout/sync_tensors_copied"] == 0
        assert torch.equal(pool._policy["model.layers.2.self_attn.o_proj.weight"], lin.weight)
        assert pool.generate(PROMPTS, spec=False).response_ids == local.generate(PROMPTS, spec=False).response_ids
    finally:
        lin.weight = old
        bump(model)
        pool.sync()


@pytest.mark.slow
def test_drafter_updates_reach_workers(setup):
    _, drafter, local, pool = setup
    with torch.no_grad():
        drafter.fc.weight.mul_(0.0)  # a drafter that proposes junk: acceptance changes, outputs do not
    bump(drafter)
    a, b = pool.generate(PROMPTS, spec=True), local.generate(PROMPTS, spec=True)
    assert a.response_ids == b.response_ids and a.accepted == b.accepted and a.drafted == b.drafted


def test_merge_of_empty_stats_and_offsets():
    from tlt.rollout.batch import RolloutBatch
    from tlt.rollout.stats import RolloutStats

    def part(n_prompts, g):
        n = n_prompts * g
        stats = RolloutStats(tokens=n, accepted_pos=[1, 2], drafted_pos=[3, 4], strategy={"0": {"1": 2}},
                             tail_time_s=0.1 * n_prompts)
        return RolloutBatch([[1]] * n, [[5]] * n, [[0.0]] * n, [i // g for i in range(n)], [True] * n, [0] * n,
                            [0] * n, [1] * n, stats=stats)
    m = merge_batches([part(2, 3), part(1, 3)], 3, wall_s=1.0, idle_s=0.2)
    assert m.group_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert m.stats.accepted_pos == [2, 4] and m.stats.drafted_pos == [6, 8]
    assert m.stats.strategy == {"0": {"1": 4}} and m.stats.tokens == 9
    assert m.stats.time_s == 1.0 and m.stats.tail_time_s == pytest.approx(0.2)


@pytest.mark.slow
def test_workers_exit_on_close():
    model = tiny_model("llama", layers=2, hidden=128, vocab=64, seed=1)
    pool = WorkerPool(model, RolloutConfig(max_new_tokens=4, tuner=True), [2], 0, n_workers=2, threads=1)
    procs = list(pool.procs)
    # each worker calibrated its own bandit on its own cores before it said ready (rollout.tuner_calibrate)
    assert all(c is not None and c["seconds"] > 0 and c["buckets"] == RolloutConfig().tuner_buckets
               for c in pool.calibrations), pool.calibrations
    # the drafter's measured acceptance reaches every worker, each re-pricing its own curve (threshold: 0 at rate 0)
    first = pool.set_accept_prior(0.0)
    assert first is pool.calibrations[0] and all(c["prior_accept_rate"] == 0.0 and c["tail_threshold"] == 0
                                                 for c in pool.calibrations), pool.calibrations
    assert len(pool.generate([[1, 3], [1, 4], [1, 5]], group_size=2, temperature=1.0).response_ids) == 6
    pool.close()
    assert all(not p.is_alive() for p in procs)


def test_spec_guard_trips_and_rearms_through_the_pool():
    """rollout.guard_patience with rollout.workers 2: each worker's engine keeps its own guard over its
    shard; the merged rollout reports the tiers off, and a new drafter version re-arms them."""
    torch.manual_seed(0)
    target = tiny_model("llama", layers=2, vocab=64, seed=1)
    drafter = build_drafter(target, DrafterConfig(draft_vocab_size=64))
    with torch.no_grad():
        drafter.lm_head.weight.zero_()  # every draft is draft slot 0: almost never the target's token
    cfg = RolloutConfig(max_new_tokens=24, temperature=0.0, spec_threshold=100, spec_patience=3, tuner=False,
                        drafter="eagle", strategy=SpecStrategy(depth=3, topk=1, tokens=3), guard_patience=2)
    pool = WorkerPool(target, cfg, [], 0, n_workers=2, drafter=drafter.eval(), threads=1)
    prompts = [[5, 6, 7], [9, 3, 4, 8], [11, 12], [20, 21, 22, 23, 24]]
    try:
        first = pool.generate(prompts)
        assert first.stats.spec_row_passes > 0 and first.stats.accept_len < 1.2
        assert rollout_metrics(first)["spec/guard_tripped"] == 0.0  # patience 2: no verdict after one rollout
        # Each worker trips its tier after 2 rollouts below break-even (measured from its own step
        # times, so a rollout slowed by a busy machine may count as above); a few more rollouts at most.
        outs = [pool.generate(prompts) for _ in range(2)]
        while outs[-1].stats.spec_row_passes and len(outs) < 8:
            outs.append(pool.generate(prompts))
        off = outs[-1]  # both workers decode their tier without SD now, same tokens
        assert off.stats.spec_row_passes == 0 and off.response_ids == first.response_ids
        assert rollout_metrics(off)["spec/guard_tripped"] == 1.0
        with torch.no_grad():  # a refresh: new drafter weights, a new version
            drafter.lm_head.weight.copy_(target.lm_head.weight)
        assert pool.generate(prompts).stats.spec_row_passes == 0  # written without a bump: not a new drafter
        bump(drafter)
        again = pool.generate(prompts)
        assert again.stats.spec_row_passes > 0 and again.response_ids == first.response_ids
        assert rollout_metrics(again)["spec/guard_tripped"] == 0.0
    finally:
        pool.close()
