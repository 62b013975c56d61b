"""Weight versions: how the rollout engines know that the policy or the drafter changed.

Every component that writes a model's weights calls `bump(module)` once it is done (the policy
update, a checkpoint restore, a drafter refresh or load, a champion load). A consumer (an engine,
a rollout-dtype copy, a worker pool) keeps a `Synced` record of the versions it last took and
syncs exactly when one moved: no look at the weights themselves, so a check costs nothing and
works whatever wrote them (DeepSpeed writes through its flat buffers, which torch's own tensor
version counters do not see).

The version is an integer stored on the module object (0 until its first bump); a wrapper such as
a DeepSpeed engine keeps the same module object, so it carries the version.
"""
from __future__ import annotations

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
