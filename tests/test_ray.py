"""Scale-out on Ray (`make test-ray`): rollout actors in a placement group, DeepSpeed ZeRO ranks as
actors, a dead actor survived, and the smoke recipe end to end on a local Ray instance (2 CPUs)."""
import inspect
import os
import signal

import pytest
import test_protocols
import torch

ray = pytest.importorskip("ray")

from tlt.cluster import RayDeepSpeedUpdater, RayPlacement, RayRolloutPool  # noqa: E402
from tlt.config import ClusterConfig, DrafterConfig, RLConfig, RolloutConfig, SpecStrategy, TrainerConfig  # noqa: E402
from tlt.drafter.model import build_drafter  # noqa: E402
from tlt.models import tiny_model  # noqa: E402
from tlt.rl.logprobs import forward_logprobs, make_batch  # noqa: E402
from tlt.rollout.contract import Engine  # noqa: E402
from tlt.rl.update import DeepSpeedUpdater, PolicyBatch  # noqa: E402
from tlt.rollout import RolloutEngine  # noqa: E402
from tlt.versions import bump, version_of, write_weights  # noqa: E402

pytestmark = pytest.mark.ray
PROMPTS = [[1, 5, 9, 13], [1, 7, 7], [1, 20, 21, 22, 23], [1, 30], [1, 4, 4, 4, 4, 4], [1, 60, 3]]
CFG = RolloutConfig(max_new_tokens=12, temperature=0.0, spec_threshold=100, tuner=False,
                    strategy=SpecStrategy(depth=3, topk=1, tokens=3))


@pytest.fixture(scope="module")
def placement():
    """One local Ray instance for the module: 2 rollout bundles + 2 trainer bundles of half a CPU."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cfg = ClusterConfig(backend="ray", rollout_actors=2, rollout_actor_cpus=0.5, trainer_cpus=0.5, max_restarts=2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pl = RayPlacement.start(cfg, world_size=2)
    yield pl
    pl.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def setup(placement):
    torch.manual_seed(0)
    model = tiny_model("llama", layers=2, hidden=128, vocab=256, seed=3)
    drafter = build_drafter(model, DrafterConfig(draft_vocab_size=0))
    local = RolloutEngine(model, CFG, eos_ids=[2], pad_id=0, drafter=drafter)
    pool = RayRolloutPool(placement, model, CFG, [2], 0, drafter=drafter)
    yield model, drafter, local, pool
    pool.close()


def test_actors_match_the_local_engine_and_report_the_new_version(setup):
    model, drafter, local, pool = setup
    assert pool.version == 0 and len(set(pool.pids())) == 2 and os.getpid() not in pool.pids()
    ref = local.generate(PROMPTS, group_size=2, spec=True)
    tails = []
    out = pool.generate(PROMPTS, group_size=2, spec=True, on_tail=tails.append)
    assert out.response_ids == ref.response_ids and out.prompt_ids == ref.prompt_ids
    assert out.group_index == ref.group_index == [i // 2 for i in range(12)]
    # each actor's engine is in its tail from the first step (threshold 100): the first to report it
    # starts the driver's tail with its running rows (3 prompts x 2), before any shard is back
    assert tails == [6] and out.stats.workers == 2 and out.stats.spec_steps > 0
    no_tail = []  # engines that never reach a tail (threshold 0): the first shard back starts it
    pool.generate(PROMPTS, spec=False, spec_threshold=0, on_tail=no_tail.append)
    assert no_tail == [1]
    assert pool.sync(model)["cluster/weights_pushed"] == 0.0 and pool.version == 0  # no version moved
    bump(model)  # what an update does
    m = pool.sync(model)
    assert m["cluster/weights_pushed"] == 1.0 and m["rollout/policy_version"] == 0 and pool.version == 1
    assert m["cluster/drafter_version"] == version_of(drafter)
    w = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        saved = w.clone()
        w.add_(torch.randn_like(w) * 0.5)  # changed outside a step (a resume, which bumps the version)
    bump(model)
    after = pool.generate(PROMPTS, spec=False)
    assert pool.version == 2 and pool.rollout_version == 2 and pool.sync(model)["rollout/policy_version"] == 2.0
    assert after.response_ids == local.generate(PROMPTS, spec=False).response_ids
    assert after.response_ids != ref.response_ids[::2]  # the new policy decodes differently
    pool.generate(PROMPTS, spec=False)
    assert pool.version == pool.rollout_version == 2  # nothing changed since: no push
    write_weights(model, {"model.layers.1.mlp.down_proj.weight": saved}, strict=False)


def test_pool_contract_capabilities_state_and_no_fixed_strategy(setup):
    """The pool reports its actors' torch engines' capabilities (trees, no bandit: tuner off), keeps
    no checkpoint state in the driver, and a fixed-strategy measurement raises with the reason."""
    from tlt.rollout.contract import EngineCapabilityError

    pool = setup[3]
    caps = pool.capabilities
    assert caps.tree_strategies and not caps.tuner and not caps.fixed_strategy and "Ray rollout pool" in caps.name
    assert pool.state_dict() == {}
    with pytest.raises(EngineCapabilityError, match="cannot measure a fixed strategy"):
        with pool.fixed_strategy(CFG.strategy, 2):
            pass


def test_zero2_updates_in_the_driver_reach_the_actors(setup, monkeypatch, tmp_path):
    """World size 1 keeps the update in the driver; ZeRO-2 writes the parameters through views that
    torch's tensor version counters miss; the updater bumps the policy's version, so `sync` pushes after
    every update, and the actors decode with it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    model, _, local, pool = setup
    updater = DeepSpeedUpdater(model, RLConfig(lr=1e-2), TrainerConfig(backend="deepspeed", zero_stage=2))
    try:
        for _ in range(2):
            before = pool.version
            updater.step(_policy_batch(model))
            model.eval()
            assert pool.sync(model)["cluster/weights_pushed"] == 1.0 and pool.version == before + 1
            out = pool.generate(PROMPTS, spec=False)
            assert pool.rollout_version == pool.version
            assert out.response_ids == local.generate(PROMPTS, spec=False).response_ids
    finally:
        updater.close()


def test_an_actor_killed_mid_rollout_is_restarted_and_its_shard_rerun(setup, placement, monkeypatch):
    """TLT_FAULT=rollout_actor:1 SIGKILLs actor 1 as its first shard starts (a lost node, an OOM
    kill): Ray restarts it, the pool loads the current version into it and re-runs the shard; the
    outputs equal an undisturbed rollout's. An actor killed between rollouts is caught too."""
    model, drafter, local, old_pool = setup
    old_pool.close()  # free the rollout bundles for a pool whose actors carry the fault
    monkeypatch.setenv("TLT_FAULT", "rollout_actor:1")
    pool = RayRolloutPool(placement, model, CFG, [2], 0, drafter=drafter)
    try:
        ref = local.generate(PROMPTS, group_size=2, spec=False).response_ids
        first = pool.pids()[1]
        out = pool.generate(PROMPTS, group_size=2, spec=False)
        assert out.response_ids == ref and pool.restarts == 1 and pool.rollout_version == pool.version == 0
        second = pool.pids()[1]
        assert second != first  # a new process, and it did not fault again (reconstructed)
        os.kill(second, signal.SIGKILL)  # between rollouts this time
        assert pool.generate(PROMPTS, group_size=2, spec=False).response_ids == ref
        assert pool.restarts == 2 and pool.sync(model)["cluster/actor_restarts"] == 2.0
    finally:
        pool.close()


@pytest.mark.parametrize("cls, like", [(RayRolloutPool, None), (RayDeepSpeedUpdater, DeepSpeedUpdater)])
def test_same_interfaces_as_the_local_classes(cls, like):
    """The pool is an `Engine` (as WorkerPool); the ranks' updater has DeepSpeedUpdater's methods."""
    if like is None:
        test_protocols.test_class_has_every_protocol_member(cls, Engine)
        return
    for name in ("step", "state_dict", "load_state_dict", "close"):
        want = [p for p in inspect.signature(getattr(like, name)).parameters if p not in ("self", "denom")]
        assert all(p in inspect.signature(getattr(cls, name)).parameters for p in want), name


def _policy_batch(model) -> PolicyBatch:
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11]]
    responses = [[20, 21, 22], [23, 24, 25, 26, 27], [28], [29, 30]]
    ids, attn, resp, pos = make_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        old = forward_logprobs(model, ids, attn, resp, position_ids=pos).logp
    return PolicyBatch(ids, attn, resp, old, torch.tensor([1.0, -1.0, 0.5, -0.5]), position_ids=pos)


# Tolerances of the data-parallel checks, derived from the mechanism (not measured on one machine).
# Both world sizes run the same per-row forwards (micro-batch 1); they differ only in the order in
# which fp32 gradients are summed (gloo's allreduce vs local accumulation) and in ZeRO's flat-buffer
# partitioning. fp32 summation of n terms errs by at most ~n * 2^-24 relative to the sum of their
# magnitudes: 4 rows x 2 steps is far below 1e-4. A rank that forgot to average (the 2x-gradient
# bug) is off by 100 % of the update, 10^4 times the bound. Weights near 1 (the norms) round to
# one fp32 ulp (1.2e-7) on each side, so the SGD checks use lr 1e-2: the distance moved (~1e-2)
# keeps that ulp under the bound.
_LINEAR_REL = 1e-4
_SGD_FREE_CLIP = 1e9  # no clipping: a clip rescales a 2x gradient to the same norm and would hide it


def _pair(placement, rl: RLConfig, seed: int = 0):
    """(world-size-1 updater and model, world-size-2 ZeRO-2 updater and model, a second world-size-1
    updater whose gradients are doubled: what ranks that sum instead of average would apply)."""
    trainer = TrainerConfig(backend="deepspeed", zero_stage=2, micro_batch_size=1, world_size=2,
                            grad_clip=_SGD_FREE_CLIP)
    one, two, bug = (tiny_model(layers=2, hidden=128, vocab=64, seed=seed) for _ in range(3))
    single = trainer.model_copy(update={"world_size": 1})
    return (DeepSpeedUpdater(one, rl, single), one, RayDeepSpeedUpdater(placement, two, rl, trainer), two,
            DeepSpeedUpdater(bug, rl, single), bug)


def _max_gap(a, b) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters()))


def _doubled(upd, batch):
    """The 2x-gradient bug: the loss's token count halved = every gradient doubled."""
    return upd.step(batch, denom=float(batch.response_mask.sum()) / 2)


def test_zero2_world_size_2_equals_world_size_1_with_sgd(placement, monkeypatch, tmp_path):
    """Two ZeRO-2 ranks (Ray actors, gloo) on halves of the batch vs one rank on all of it, with plain
    SGD: the update is linear in the gradient, so parameters agree to fp32 summation rounding
    (`_LINEAR_REL` of the distance moved), as do the loss and the grad norm. Negative control in the
    same run: a world-size-1 update with doubled gradients (ranks that sum instead of average) is
    off by the whole distance moved and fails the same bound."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    ref, one, dist, two, bug_upd, bug = _pair(placement, RLConfig(lr=1e-2, optimizer="sgd"))
    start = [p.detach().clone() for p in two.parameters()]
    try:
        for _ in range(2):
            batch = _policy_batch(one)
            m1, m2 = ref.step(batch), dist.step(batch)
            _doubled(bug_upd, batch)
            # per-row forwards are identical; only the order of adding 4 Python floats differs
            assert m2["policy/loss"] == pytest.approx(m1["policy/loss"], abs=1e-6)
            # a sum of squares over every gradient element: fp32 rounding of the summed gradients
            assert m2["policy/grad_norm"] == pytest.approx(m1["policy/grad_norm"], rel=_LINEAR_REL)
        moved = max(float((a - b).detach().abs().max()) for a, b in zip(two.parameters(), start))
        diff, bug_diff = _max_gap(one, two), _max_gap(bug, two)
        print(f"SGD ZeRO-2 world size 2 vs 1: max |dparam| {diff:.2e}, moved {moved:.2e}, 2x-gradient bug {bug_diff:.2e}")
        assert moved > 0 and diff <= _LINEAR_REL * moved  # the driver's model holds rank 0's updated weights
        assert bug_diff > _LINEAR_REL * moved  # the check catches ranks that do not average
    finally:
        for u in (bug_upd, dist, ref):  # the first world-size-1 engine owns the process group: last
            u.close()


def _exp_avgs(state: dict, ranks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's (exp_avg, exp_avg_sq) over the whole flat parameter group: ZeRO-2 keeps one partition
    per rank (the last one padded), concatenated here in rank order."""
    parts = state["ranks"] if ranks else [state]
    avg = [p["base_optimizer_state"]["state"][0]["exp_avg"] for p in parts]
    sq = [p["base_optimizer_state"]["state"][0]["exp_avg_sq"] for p in parts]
    return torch.cat(avg), torch.cat(sq)


def _assert_same_adam_state(ref_state: dict, dist_state: dict) -> None:
    (a1, s1), (a2, s2) = _exp_avgs(ref_state, ranks=False), _exp_avgs(dist_state, ranks=True)
    n = a1.numel()
    assert torch.all(a2[n:] == 0)  # ZeRO's alignment padding carries no state
    # exp_avg is linear and exp_avg_sq quadratic in the gradients: fp32 rounding only
    assert float((a2[:n] - a1).abs().max()) <= _LINEAR_REL * float(a1.abs().max())
    assert float((s2[:n] - s1).abs().max()) <= 2 * _LINEAR_REL * float(s1.abs().max())


def test_zero2_adam_state_is_partitioned_and_round_trips(placement, monkeypatch, tmp_path):
    """What AdamW adds at world size 2: the optimizer state, partitioned over the ranks by ZeRO-2,
    equals world size 1's (exp_avg is linear in the gradients, so `_LINEAR_REL`), survives the
    state_dict/load_state_dict round trip of a resume, and the 2x-gradient bug fails the check.

    Parameters are compared with a bound from the mechanism, not a measurement: in Adam's first
    steps each element moves by at most ~lr (bias-corrected m/sqrt(v) <= 1.002 for steps 1-3, plus
    lr * weight_decay * |w|), and a gradient at rounding level may flip sign between the two runs, so
    two runs can differ by at most 2 * lr * 1.01 per step, whatever the CPU's kernels."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    rl = RLConfig(lr=5e-5)
    ref, one, dist, two, bug_upd, bug = _pair(placement, rl)
    try:
        for _ in range(2):
            batch = _policy_batch(one)
            ref.step(batch), dist.step(batch), _doubled(bug_upd, batch)
        state, ref_state = dist.state_dict(), ref.state_dict()
        assert state["world_size"] == 2 and len(state["ranks"]) == 2  # ZeRO partitions: one state per rank
        _assert_same_adam_state(ref_state, state)
        with pytest.raises(AssertionError):  # negative control: doubled gradients, doubled exp_avg
            _assert_same_adam_state(bug_upd.state_dict(), state)
        assert _max_gap(one, two) <= 2 * 2 * rl.lr * 1.01
        dist.load_state_dict(state)  # a resume: the next step continues as if never interrupted
        batch = _policy_batch(one)
        ref.step(batch), dist.step(batch)
        _assert_same_adam_state(ref.state_dict(), dist.state_dict())
        assert _max_gap(one, two) <= 3 * 2 * rl.lr * 1.01
        with pytest.raises(ValueError, match="world_size=2"):
            RayDeepSpeedUpdater(placement, two, rl, TrainerConfig(backend="deepspeed", zero_stage=2, world_size=3)
                                ).load_state_dict(state)
    finally:
        for u in (bug_upd, dist, ref):  # the first world-size-1 engine owns the process group: last
            u.close()


def test_uneven_rows_are_padded_and_the_drafter_sees_every_real_row_once(placement, monkeypatch, tmp_path):
    """5 rows over 2 ranks (one padding row with no response tokens): still world size 1's update,
    and the update's forwards reach `on_forward` for rows 0..4 exactly, with world size 1's features.
    SGD, so the update is linear in the gradient and the bound is fp32 rounding (see `_LINEAR_REL`)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    rl = RLConfig(lr=1e-2, optimizer="sgd")
    trainer = TrainerConfig(backend="deepspeed", zero_stage=2, micro_batch_size=1, world_size=2,
                            grad_clip=_SGD_FREE_CLIP)
    one, two = tiny_model(layers=2, hidden=128, vocab=64, seed=1), tiny_model(layers=2, hidden=128, vocab=64, seed=1)
    full = _policy_batch(one)
    batch = PolicyBatch(*(None if t is None else torch.cat([t, t[:1]]) for t in (
        getattr(full, f) for f in PolicyBatch.__dataclass_fields__)))  # 5 rows
    seen: dict[int, list] = {1: [], 2: []}
    start = [p.detach().clone() for p in two.parameters()]
    ref = DeepSpeedUpdater(one, rl, trainer.model_copy(update={"world_size": 1}))
    dist = RayDeepSpeedUpdater(placement, two, rl, trainer)
    try:
        for ws, upd in ((1, ref), (2, dist)):
            m = upd.step(batch, aux_layer_ids=[0, 1], on_forward=lambda s, mb, out, ws=ws: seen[ws].append((s, out.aux)))
            assert m["policy/entropy"] > 0
        assert [s for s, _ in seen[2]] == [s for s, _ in seen[1]] == [0, 1, 2, 3, 4]
        for (_, a), (_, b) in zip(seen[1], seen[2]):  # the same per-row forward on both sides (first
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # step: same weights): ~1e-7 apart at most
        moved = max(float((a - b).detach().abs().max()) for a, b in zip(two.parameters(), start))
        assert moved > 0 and _max_gap(one, two) <= _LINEAR_REL * moved
    finally:
        ref.close()
        dist.close()
