"""Fresh weights by construction: every state-dict load or tensor copy into a policy or a drafter
goes through `tlt.versions.write_weights`, which bumps the version the rollout engines sync by,
so no writer can leave an engine decoding stale weights by forgetting a `bump`."""
import ast
import re
from pathlib import Path

import pytest
import torch

from tlt.config import DrafterConfig, RolloutConfig
from tlt.drafter.model import build_drafter
from tlt.models import tiny_model
from tlt.rollout import RolloutEngine
from tlt.versions import version_of, write_weights

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tlt", "bench")
WRITES = ("load_state_dict", "copy_")
# A receiver naming one of these is a policy or a drafter (or a tensor of one): `model`, `ctx.model`,
# `self.drafter`, `p.drafter`, `drafter.lm_head.weight`, `master`, `target.lm_head.weight`, `module`
# (a loop over both). Optimizers, trainers, updaters, refreshers, engines, buffers and schedules
# (`self.trainer.opt`, `ctx.updater`, `engine.optimizer`, ...) name none of them.
WEIGHTS = re.compile(r"model|policy|drafter|master|target|module", re.IGNORECASE)

# (file, enclosing function) -> why a write there may skip `write_weights`.
WRITES_ALLOWED = {
    ("tlt/versions.py", "write_weights"): "the helper itself: loads, then bumps",
    ("tlt/drafter/model.py", "build_drafter"): "construction: the new drafter's head and norm start from the "
                                               "target's, before any engine holds it (version 0)",
}


def _receiver_names(node: ast.expr):
    """The identifiers along a receiver's chain (`self.drafter.lm_head.weight` -> weight, lm_head,
    drafter, self); subscript indices are not part of it (`state[k]` names `state`)."""
    while True:
        if isinstance(node, ast.Attribute):
            yield node.attr
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            if isinstance(node, ast.Name):
                yield node.id
            return


def weight_writes(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    """(innermost enclosing function or "module", call) for every `X.load_state_dict(...)` or
    `X.copy_(...)` whose receiver X names a policy or a drafter."""
    found = []

    def walk(node, where):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITES \
                and any(WEIGHTS.search(n) for n in _receiver_names(node.func.value)):
            found.append((where, node))
        for child in ast.iter_child_nodes(node):
            walk(child, where)
    walk(tree, "module")
    return found


def test_weights_are_written_only_through_write_weights():
    """A bare load or copy into a policy or drafter is a writer that may forget the bump: use
    `tlt.versions.write_weights` (a partial state with strict=False writes single tensors)."""
    bad, used = [], set()
    for p in (path for d in SCANNED for path in (ROOT / d).rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        for where, call in weight_writes(ast.parse(p.read_text())):
            if (rel, where) in WRITES_ALLOWED:
                used.add((rel, where))
            else:
                bad.append(f"{rel}:{call.lineno} {ast.unparse(call)} in {where}")
    assert not bad, f"write these through tlt.versions.write_weights: {bad}"
    assert used == set(WRITES_ALLOWED), f"stale WRITES_ALLOWED entries: {set(WRITES_ALLOWED) - used}"


@pytest.mark.parametrize("code, flagged", [
    ("p.drafter.load_state_dict(ref, strict=True)", True),  # bench/rl_step.py's re-sync, before the helper
    ("ctx.model.load_state_dict(tensors['policy'])", True),
    ("module.load_state_dict(weights[name], strict=True)", True),
    ("drafter.lm_head.weight.copy_(head)", True),
    ("model.get_input_embeddings().weight.copy_(e)", True),
    ("self.trainer.opt.load_state_dict(state['optimizer'])", False),
    ("ctx.updater.load_state_dict(s)", False),
    ("engine.optimizer.load_state_dict(s)", False),
    ("ctx.refresher.load_state_dict(s)", False),
    ("self.state[k].copy_(v)", False),  # the spot trainer's shared tensors
    ("mine[name].copy_(tensor)", False),  # the torch engine's rollout copy (the reader)
])
def test_the_rule_flags_writers_not_other_state(code, flagged):
    assert bool(weight_writes(ast.parse(code))) == flagged


def test_write_weights_bumps_even_a_failed_or_partial_load():
    lin = torch.nn.Linear(3, 2)
    ptr = lin.weight.data_ptr()
    assert write_weights(lin, {"weight": torch.ones(2, 3)}, strict=False).missing_keys == ["bias"]
    assert version_of(lin) == 1 and lin.weight.data_ptr() == ptr and torch.equal(lin.weight, torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="size mismatch"):
        write_weights(lin, {"weight": torch.ones(3, 3), "bias": torch.zeros(2)})  # bias may be copied by then
    assert version_of(lin) == 2


def _engine(model, drafter):
    """bfloat16 rollout: the engine decodes copies of the fp32 policy and drafter, refreshed by version."""
    cfg = RolloutConfig(dtype="bfloat16", max_new_tokens=8, temperature=0.0, tuner=False, spec_threshold=100,
                        drafter="eagle")
    return RolloutEngine(model, cfg, [2], 0, drafter=drafter)


@pytest.mark.parametrize("written", [("policy",), ("drafter",), ("policy", "drafter")])
def test_an_engine_decodes_the_weights_write_weights_loaded(written):
    """New policy and/or drafter weights loaded (a checkpoint restore, a champion load): the engine
    built before decodes like a fresh engine on those weights, tokens and accepted drafts alike (the
    drafter copy's embedding is the policy's: a policy load alone must reach the drafting too)."""
    dcfg = DrafterConfig(draft_vocab_size=0)
    model = tiny_model(layers=2, hidden=128, vocab=64, seed=0)
    torch.manual_seed(0)
    drafter = build_drafter(model, dcfg)
    engine = _engine(model, drafter)
    prompts = [[1, 5, 9], [1, 7, 7, 3], [1, 30]]
    before = engine.generate(prompts, spec=True)
    torch.manual_seed(1)
    new = {"policy": (model, tiny_model(layers=2, hidden=128, vocab=64, seed=1).state_dict()),
           "drafter": (drafter, build_drafter(model, dcfg).state_dict())}
    versions = {name: version_of(module) for name, (module, _) in new.items()}
    for name in written:
        write_weights(*new[name])
    assert {name: version_of(module) - versions[name] for name, (module, _) in new.items()} == \
        {name: int(name in written) for name in new}
    got = engine.generate(prompts, spec=True)
    want = _engine(model, drafter).generate(prompts, spec=True)
    assert got.response_ids == want.response_ids and got.accepted == want.accepted and got.drafted == want.drafted
    assert (got.response_ids != before.response_ids) == ("policy" in written)
