"""The written contracts of tlt.rl.protocols: every engine, refresher and updater has every protocol member.

Instances that are cheap to build are checked with `isinstance` (runtime_checkable); the classes
that start processes (worker pool, vLLM, spot trainer: see also test_spot) statically, from their
class attributes and the `self.x = ...` assignments in their methods, with compatible signatures.
"""
import ast
import inspect
import textwrap

import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig, RunConfig
from tlt.drafter.model import build_drafter
from tlt.drafter.refresh import DrafterRefresher
from tlt.drafter.spot import SpotTrainer
from tlt.drafter.train import DrafterTrainer
from tlt.models import tiny_model
from tlt.rl.update import DeepSpeedUpdater, TorchUpdater
from tlt.rl.protocols import Engine, Refresher, Updater
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.vllm_backend import VllmRolloutEngine
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
