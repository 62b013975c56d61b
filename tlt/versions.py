"""Weight versions: how the rollout engines know that the policy or the drafter changed.

Every component that writes a model's weights bumps its version once it is done: a loader of a
state dict (a checkpoint restore, a drafter refresh or load, a champion load, a worker's shared
weights) writes through `write_weights`, which loads and bumps in one call, so no loader can forget
the bump (tests/test_weight_freshness.py fails on a `load_state_dict` or `copy_` into a policy or
drafter anywhere else); an optimizer step calls `bump(module)` itself. A consumer (an engine,
a rollout-dtype copy, a worker pool) keeps a `Synced` record of the versions it last took and
syncs exactly when one moved: no look at the weights themselves, so a check costs nothing and
works whatever wrote them (DeepSpeed writes through its flat buffers, which torch's own tensor
version counters do not see).

The version is an integer stored on the module object (0 until its first bump); a wrapper such as
a DeepSpeed engine keeps the same module object, so it carries the version.
"""
from __future__ import annotations

import torch

_ATTR = "_tlt_weights_version"


def version_of(module) -> int:
    """The module's weight version: how many times its weights were written (0: never)."""
    return 0 if module is None else int(module.__dict__.get(_ATTR, 0))


def bump(module) -> int:
    """Record that `module`'s weights were written; returns the new version (None: nothing to bump)."""
    if module is None:
        return 0
    module.__dict__[_ATTR] = version_of(module) + 1
    return module.__dict__[_ATTR]


def write_weights(module, state: dict, strict: bool = True, assign: bool = False):
    """Load `state` into `module` (a policy or a drafter) and bump its version; returns torch's
    (missing_keys, unexpected_keys).

    The one way weights are loaded into a policy or drafter, so every engine decoding a copy of
    it syncs. `strict` and `assign` are `load_state_dict`'s: `strict=False` with some of the
    module's keys writes those tensors in place (e.g. `{"lm_head.weight": head}`) and leaves the
    rest; `assign=True` takes the tensors themselves (a worker's model over shared memory). The
    version moves even when the load raises, since torch may have copied some tensors by then.
    """
    try:
        with torch.no_grad():
            return module.load_state_dict(state, strict=strict, assign=assign)
    finally:
        bump(module)


def stamp(module) -> tuple[int, int] | None:
    """(identity, version): changes when the weights are written or the module is replaced."""
    return None if module is None else (id(module), version_of(module))


class Synced:
    """The versions of named modules ("policy", "drafter") as a consumer last took them.

    `moved(policy=m, drafter=d)` names the modules written (or replaced) since the last
    `take(...)`; the consumer copies or sends those and then calls `take` with the same modules.
    A name never taken counts as moved.
    """

    def __init__(self, **modules):
        self._seen: dict[str, tuple[int, int] | None] = {}
        self.take(**modules)

    def moved(self, **modules) -> set[str]:
        return {name for name, m in modules.items() if name not in self._seen or stamp(m) != self._seen[name]}

    def take(self, **modules) -> None:
        self._seen.update({name: stamp(m) for name, m in modules.items()})

    def version(self, name: str) -> int:
        """The version last taken under `name` (0: none)."""
        seen = self._seen.get(name)
        return 0 if seen is None else seen[1]
