"""The written contracts of tlt.rollout.contract and tlt.rl.protocols: every engine, refresher and updater has every protocol member.

Instances that are cheap to build are checked with `isinstance` (runtime_checkable); the classes
that start processes (worker pool, vLLM, spot trainer: see also test_spot) statically, from their
class attributes and the `self.x = ...` assignments in their methods, with compatible signatures.
"""
import ast
import inspect
import json
import textwrap

import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig, RunConfig, SpecStrategy
from tlt.drafter.model import build_drafter
from tlt.drafter.refresh import DrafterRefresher
from tlt.drafter.spot import SpotTrainer
from tlt.drafter.train import DrafterTrainer
from tlt.models import tiny_model
from tlt.rl.update import DeepSpeedUpdater, TorchUpdater
from tlt.rl.protocols import Refresher, Updater
from tlt.rollout.contract import Engine
from tlt.rollout.contract import EngineCapabilityError, check_spec
from tlt.rollout.torch_engine.engine import RolloutEngine
from tlt.rollout.tuner import StrategyTuner
from tlt.rollout.vllm_engine.backend import VllmRolloutEngine
from tlt.rollout.workers import WorkerPool


def _members(proto) -> set[str]:
    names = set(proto.__annotations__)
    names |= {k for k, v in vars(proto).items() if not k.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def _instance_attrs(cls) -> set[str]:
    """Names assigned as `self.<name>` anywhere in the class body (plain, tuple and annotated)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    return names


@pytest.mark.parametrize("cls, proto", [(RolloutEngine, Engine), (WorkerPool, Engine), (VllmRolloutEngine, Engine),
                                        (DrafterRefresher, Refresher), (SpotTrainer, Refresher),
                                        (TorchUpdater, Updater), (DeepSpeedUpdater, Updater)])
def test_class_has_every_protocol_member(cls, proto):
    have = set(dir(cls)) | _instance_attrs(cls)
    assert _members(proto) <= have, _members(proto) - have
    for name, fn in vars(proto).items():
        if name.startswith("_") or not callable(fn):
            continue
        want = [p for p in inspect.signature(fn).parameters if p != "self"]
        got = inspect.signature(getattr(cls, name)).parameters
        assert all(p in got for p in want), (cls.__name__, name, want, list(got))


def test_cheap_instances_satisfy_the_protocols():
    torch.manual_seed(0)
    target = tiny_model("llama", layers=2, hidden=64, vocab=128)
    cfg = DrafterConfig(draft_vocab_size=0, schedule="every_k")
    drafter = build_drafter(target, cfg)
    engine = RolloutEngine(target, RolloutConfig(max_new_tokens=4), eos_ids=[2], pad_id=0, drafter=drafter)
    refresher = DrafterRefresher(DrafterTrainer(drafter, cfg, target.get_output_embeddings().weight), cfg)
    assert isinstance(engine, Engine) and isinstance(refresher, Refresher)
    assert isinstance(TorchUpdater(target, RunConfig().rl, RunConfig().trainer), Updater)
    assert engine.sync(target) == {} and refresher.before_rollout(0) is None and refresher.after_rollout() == {}


def test_on_tail_is_a_generate_argument():
    """The tail hook goes with the call (no engine attribute to set and reset): fired once, with the
    number of running rows, when <= spec_threshold rows are left (here: from the first step)."""
    torch.manual_seed(0)
    target = tiny_model("llama", layers=2, hidden=64, vocab=128)
    engine = RolloutEngine(target, RolloutConfig(max_new_tokens=6, spec_threshold=4), eos_ids=[2], pad_id=0)
    calls = []
    engine.generate([[1, 5, 6], [1, 7]], group_size=2, temperature=1.0, on_tail=calls.append)
    assert len(calls) == 1 and 0 < calls[0] <= 4
    assert not hasattr(engine, "on_tail")


def test_ray_updater_is_an_updater():
    pytest.importorskip("ray")
    from tlt.cluster.trainer_ranks import RayDeepSpeedUpdater

    test_class_has_every_protocol_member(RayDeepSpeedUpdater, Updater)


CHAIN3 = SpecStrategy(depth=3, topk=1, tokens=3)
TREE = SpecStrategy(depth=2, topk=2, tokens=4)


def _bare(cls, **attrs):
    """An instance without its constructor (no worker process), with just the attributes its
    contract methods read."""
    obj = cls.__new__(cls)
    obj.__dict__.update(attrs)
    return obj


def test_engine_protocol_lists_behaviour_only():
    """No config, bandit or history on the contract: engines keep those to themselves."""
    assert not set(Engine.__annotations__) & {"cfg", "tuner", "history"}
    assert {"state_dict", "load_state_dict", "fixed_strategy", "capabilities"} <= _members(Engine)


def test_capabilities_say_what_each_engine_can_run():
    torch.manual_seed(0)
    target = tiny_model("llama", layers=2, hidden=64, vocab=128)
    cfg = RolloutConfig(max_new_tokens=4, tuner=True)
    engine = RolloutEngine(target, cfg, eos_ids=[2], pad_id=0, tuner=StrategyTuner.from_config(cfg))
    caps = engine.capabilities
    assert caps.tree_strategies and caps.tuner and caps.fixed_strategy and caps.sampled_sd and caps.spec
    check_spec(caps, TREE)  # the torch engine runs trees
    vllm = _bare(VllmRolloutEngine, method="eagle3", k=3, sampled_sd=False, tuner=None, cfg=cfg, sd_built=True)
    caps = vllm.capabilities
    assert not caps.tree_strategies and caps.max_depth == 3 and caps.sources == {"drafter"}
    assert not caps.sampled_sd and not caps.tuner and not caps.prompt_history and caps.spec
    assert not _bare(VllmRolloutEngine, method=None, k=3, sampled_sd=True, tuner=None).capabilities.spec
    pool = _bare(WorkerPool, cfg=cfg)
    assert pool.capabilities.tree_strategies and not pool.capabilities.fixed_strategy and pool.state_dict() == {}


@pytest.mark.parametrize("strategy, why", [(TREE, "cannot run trees"),
                                           (SpecStrategy(depth=4, topk=1, tokens=4), "depth 4 is above the 3"),
                                           (SpecStrategy(depth=2, topk=1, tokens=2, source="ngram"), "not ngram")])
def test_a_call_vllm_cannot_honour_raises_with_the_reason(strategy, why):
    """vLLM's per-call schedule consults its capabilities: trees, deeper chains, the other draft
    source raise (EngineCapabilityError, a ValueError); a chain it can run is scheduled; a sampled
    call on a build without lossless sampled SD decodes without SD, with a warning."""
    cfg = RolloutConfig(spec_threshold=4, spec_patience=1, strategy=CHAIN3)
    vllm = _bare(VllmRolloutEngine, method="eagle3", k=3, sampled_sd=False, tuner=None, cfg=cfg, sd_built=True)
    assert vllm._sd_options(True, 4, 0.0) == {"sd_threshold": 4, "sd_k": 3, "patience": 1}
    assert vllm._sd_options(False, 4, 0.0)["sd_k"] == 0
    with pytest.warns(UserWarning, match="decodes without SD"):
        assert vllm._sd_options(True, 4, 0.7)["sd_k"] == 0
    vllm.cfg = cfg.model_copy(update={"strategy": strategy})
    with pytest.raises(EngineCapabilityError, match=f"vLLM cannot run strategy.*{why}"):
        vllm._sd_options(True, 4, 0.0)
    with pytest.raises(EngineCapabilityError, match=why):
        with vllm.fixed_strategy(strategy, 4):
            pass
    vllm.method = None
    with pytest.raises(ValueError, match="built without speculation"):
        vllm._sd_options(True, 4, 0.0)


def test_fixed_strategy_leaves_the_engine_as_it_was():
    """Inside the block: the fixed chain, no tuner, no guard, an empty history; afterwards the same
    config, tuner and history objects, the tuner untouched, the history without the block's answers
    (also when the block raises). A pool cannot measure: it says why."""
    torch.manual_seed(0)
    target = tiny_model("llama", layers=2, hidden=64, vocab=128)
    cfg = RolloutConfig(max_new_tokens=4, tuner=True, group_drafts=True, guard_patience=3)
    tuner = StrategyTuner.from_config(cfg)
    drafter = build_drafter(target, DrafterConfig(draft_vocab_size=0))
    engine = RolloutEngine(target, cfg, eos_ids=[2], pad_id=0, drafter=drafter, tuner=tuner)
    history, before = engine.history, tuner.state()
    with engine.fixed_strategy(CHAIN3, batch_size=2):
        out = engine.generate([[1, 5, 6], [1, 7]], temperature=0.0, spec=True)
        assert not engine.capabilities.tuner
    assert out.stats.spec_row_passes > 0 and len(history) == 0
    assert engine.cfg is cfg and engine.tuner is tuner and engine.history is history and tuner.state() == before
    with pytest.raises(RuntimeError, match="inside"):
        with engine.fixed_strategy(CHAIN3, batch_size=2):
            raise RuntimeError("inside")
    assert engine.cfg is cfg and engine.tuner is tuner and engine.history is history
    with pytest.raises(EngineCapabilityError, match="plain"):
        with engine.fixed_strategy(SpecStrategy(depth=0, topk=1, tokens=0)):
            pass
    with pytest.raises(EngineCapabilityError, match="worker pool cannot measure a fixed strategy"):
        with _bare(WorkerPool, cfg=cfg).fixed_strategy(CHAIN3):
            pass


def test_engine_state_dict_round_trips_the_bandit():
    """`state_dict` holds the bandit (JSON-able), `load_state_dict` restores it into another engine;
    an engine without a bandit has nothing to save and ignores a saved one."""
    torch.manual_seed(0)
    target = tiny_model("llama", layers=2, hidden=64, vocab=128)
    cfg = RolloutConfig(max_new_tokens=4, tuner=True)
    a = RolloutEngine(target, cfg, eos_ids=[2], pad_id=0, tuner=StrategyTuner.from_config(cfg, seed=1))
    for i in range(30):
        arm = a.tuner.choose(1 + i % 8)
        a.tuner.update(1 + i % 8, arm, float(i % 5))
    state = json.loads(json.dumps(a.state_dict()))
    b = RolloutEngine(target, cfg, eos_ids=[2], pad_id=0, tuner=StrategyTuner.from_config(cfg, seed=2))
    assert b.state_dict() != state
    b.load_state_dict(state)
    assert b.state_dict() == state
    plain = RolloutEngine(target, cfg, eos_ids=[2], pad_id=0)
    plain.load_state_dict(state)
    assert plain.state_dict() == {}
