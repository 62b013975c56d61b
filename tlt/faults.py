"""Fault injection for crash tests: a no-op unless `TLT_FAULT` is set.

`TLT_FAULT=<point>:<step>[:raise][,...]`, <step> the 0-based step index the flow passes (RL step
<step> + 1 in log lines and checkpoint folders), e.g. `TLT_FAULT=update:2` SIGKILLs this process
when RL step 3 reaches its policy update (no cleanup, no atexit: what a crash or an OOM kill looks like);
`update:1:raise` raises `InjectedFault` there once per process instead (a retried flow then gets
past it). Points: rollout, update, refresh, checkpoint (inside a save, before the atomic rename),
checkpointed (after the save, before the step's metrics are logged), spot (in the spot trainer's
worker process, after drafter step <step>: kills the worker only, a preemption).
"""
from __future__ import annotations

import os
import signal

_fired: set[str] = set()


class InjectedFault(RuntimeError):
    """Raised by a `:raise` fault (a transient failure that a retry gets past)."""


def fault(point: str, step: int) -> None:
    """SIGKILL (or raise) here when TLT_FAULT names this point and step."""
    spec = os.environ.get("TLT_FAULT")
    if not spec:
        return
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[:2] != [point, str(step)]:
            continue
        if parts[2:] == ["raise"]:
            if item not in _fired:
                _fired.add(item)
                raise InjectedFault(f"injected fault at {point}:{step}")
        else:
            os.kill(os.getpid(), signal.SIGKILL)
