"""drafter.schedule means one thing under either drafter.where: the payoff estimate as pure
functions over synthetic measurements, and which RL steps the sequential refresher trains in
(the spot trainer's tails are counted against the same cases in test_spot.py)."""
import pytest
import torch

from tlt.config import DrafterConfig
from tlt.config.loading import ConfigError, load_config
from tlt.drafter.model import build_drafter
from tlt.drafter.refresh import DrafterRefresher
from tlt.drafter.schedule import PayoffInputs, RefreshSchedule, payoff_s, refresh_cost_s, refresh_saving_s
from tlt.drafter.train import DrafterTrainer
from tlt.models import tiny_model
from tlt.rl.logprobs import forward_logprobs, make_batch

BASE = PayoffInputs(accept_now=2.0, accept_fresh=2.6, steps_since=2, tail_s=10.0, cost_s=3.0, horizon=4)

# (schedule keys, the rollouts' accept lengths, steps trained: spot (next tail), sequential (after the update))
CASES = {
    "every_k k=2": ({"schedule": "every_k", "refresh_every": 2}, [2.0] * 4,
                    [False, True, False, True], [False, True, False, True]),
    "frozen": ({"schedule": "frozen"}, [1.0] * 3, [False] * 3, [False] * 3),
    "below_accept": ({"schedule": "below_accept", "refresh_below_accept_len": 2.0}, [2.5, 1.5, 2.4, 1.0],
                     [False, False, True, False], [False, True, False, True]),
}


def step_metrics(accept: float | None, tail_s: float = 10.0) -> dict[str, float]:
    m = {"rollout/time_s": 2 * tail_s, "rollout/tail_share": 0.5}
    return m if accept is None else {**m, "spec/accept_len/mean": accept}


# ---------------------------------------------------------------- the payoff estimate
def test_payoff_both_decisions_reachable():
    assert payoff_s(BASE) > 0  # 23 % of the accept length lost, 10 s of tail a step, 3 s to refresh
    assert payoff_s(BASE.__class__(**{**BASE.__dict__, "cost_s": 100.0})) < 0
    assert refresh_saving_s(BASE.__class__(**{**BASE.__dict__, "accept_now": 2.6})) == 0  # no drift: nothing to win


def test_payoff_grows_as_the_accept_length_falls():
    """At a steady drift (0.1 per RL step), the further the accept length fell below the level
    the last refresh reached, the more a refresh saves."""
    steady = {**BASE.__dict__, "cost_s": 5.0}
    vals = [payoff_s(PayoffInputs(**{**steady, "accept_now": 2.6 - 0.1 * k, "steps_since": k})) for k in range(1, 14)]
    assert all(b > a for a, b in zip(vals, vals[1:])), vals
    assert vals[0] < 0 < vals[-1]  # 0.1 below: not worth 5 s; 1.3 below: well worth it


@pytest.mark.parametrize("field, values, sign", [
    ("tail_s", (2.0, 11.0, 20.0), +1),  # the longer the speculative tail, the more it saves
    ("horizon", (1, 4, 8), +1),  # the longer the refresh is credited, the more it saves
    ("cost_s", (1.0, 5.0, 9.0), -1),  # the dearer the refresh, the less it pays
])
def test_payoff_is_monotone(field, values, sign):
    vals = [payoff_s(PayoffInputs(**{**BASE.__dict__, field: v})) for v in values]
    assert all(sign * (b - a) > 0 for a, b in zip(vals, vals[1:])), vals


def test_refresh_cost():
    assert refresh_cost_s("sequential", 0.5, 8, tail_s=10.0, threads=1, cpus=2) == 4.0  # drafter steps x step time
    assert refresh_cost_s("sequential", None, 8, tail_s=10.0, threads=1, cpus=2) == 0.0  # not measured yet
    assert refresh_cost_s("spot", None, 8, tail_s=10.0, threads=1, cpus=2) == 5.0  # one of two cores for the tail
    assert refresh_cost_s("spot", None, 8, tail_s=10.0, threads=1, cpus=16) < 1.0
    assert refresh_cost_s("spot", None, 8, tail_s=10.0, threads=1, cpus=0) == 0.0  # decoding on an accelerator


def test_payoff_schedule_follows_the_drift():
    """Flat accept length: never; once it drifts far enough that the tail time won pays: train."""
    sched = RefreshSchedule(DrafterConfig(schedule="payoff", where="spot"), cpus=2)
    decisions = []
    for step, accept in enumerate([2.6, 2.6, 2.6, 2.4, 2.1]):
        decisions.append(sched.due(step))  # spot: decided before the step's rollout
        assert sched.metrics()["drafter/refresh_decision"] == float(decisions[-1])
        sched.observe(step, step_metrics(accept))
    assert decisions == [False] * 5
    assert sched.metrics()["drafter/payoff_s"] < 0  # 2.6 -> 2.4: the 5 s the spare core costs outweigh it
    assert sched.due(5) and sched.metrics()["drafter/payoff_s"] > 0  # 2.6 -> 2.1: it pays; step 5's tail trains
    sched.observe(5, step_metrics(2.1))  # step 5's rollout ran before its tail's refresh
    assert not sched.due(6)  # no second refresh before the first is measured
    sched.observe(6, step_metrics(2.6))  # the first rollout after it: the new fresh level
    assert not sched.due(7)


def test_schedule_state_round_trips():
    sched = RefreshSchedule(DrafterConfig(schedule="payoff"), cpus=2)
    for step, accept in enumerate((2.6, 2.2)):
        sched.observe(step, step_metrics(accept))
    sched.due(2)
    other = RefreshSchedule(DrafterConfig(schedule="payoff"), cpus=2)
    other.load_state_dict(sched.state_dict())
    assert other.state_dict() == sched.state_dict() and other.due(3) == sched.due(3)


# ---------------------------------------------------------------- config: one spelling, checked
@pytest.mark.parametrize("sets, words", [
    (["drafter.spot=false"], ["drafter.spot", "drafter.where: sequential"]),
    (["drafter.refresh_every=0"], ["drafter.schedule: frozen"]),
    (["drafter.schedule=below_accept"], ["refresh_below_accept_len"]),
    (["drafter.refresh_below_accept_len=2"], ["drafter.schedule: below_accept"]),
    (["drafter.schedule=frozen", "drafter.refresh_every=3"], ["drafter.refresh_every", "every_k"]),
    (["drafter.payoff_horizon=8"], ["drafter.payoff_horizon", "schedule payoff"]),
])
def test_invalid_schedule_keys_refused_with_the_fix(sets, words):
    with pytest.raises(ConfigError) as err:
        load_config("conf/smoke.yaml", sets)
    assert all(w in str(err.value) for w in words), str(err.value)


# ---------------------------------------------------------------- the sequential refresher
@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    target = tiny_model("llama", layers=4, hidden=64, vocab=128)
    return target, build_drafter(target, DrafterConfig(draft_vocab_size=0))


def fill(refresher, target) -> None:
    ids, attn, resp, pos = make_batch([[1, 5, 6, 7], [1, 8, 9]], [list(range(20, 40)), list(range(50, 66))], 0)
    with torch.no_grad():
        fo = forward_logprobs(target, ids, attn, resp, aux_layer_ids=refresher.aux_layer_ids, position_ids=pos)
    refresher.add_rollouts(0, ids, attn, resp, fo.aux, fo.last_hidden)


def steps_trained(refresher, accepts: list[float | None]) -> list[bool]:
    """RL steps 0..N-1 as tlt.rl.step drives a refresher: which trained the drafter (tail or after update)?"""
    trained = []
    for step, accept in enumerate(accepts):
        hook = refresher.before_rollout(step)
        if hook is not None:
            hook(1)
        tail = refresher.after_rollout()
        after = refresher.after_update(step, step_metrics(accept))
        trained.append(tail.get("drafter/spot_steps", 0) > 0 or after.get("drafter/train_s") is not None)
        assert "drafter/refresh_decision" in {**tail, **after}
    return trained


@pytest.mark.parametrize("case", list(CASES))
def test_sequential_refresher_trains_when_the_schedule_says(parts, case):
    target, drafter = parts
    keys, accepts, _, want = CASES[case]
    cfg = DrafterConfig(draft_vocab_size=0, where="sequential", refresh_steps=2, **keys)
    refresher = DrafterRefresher(DrafterTrainer(drafter, cfg, target.get_output_embeddings().weight), cfg)
    fill(refresher, target)
    assert steps_trained(refresher, accepts) == want
    assert refresher.total_steps == 2 * sum(want)  # refresh_steps drafter steps per refresh, none otherwise
