"""When the online drafter trains: one schedule that both refreshers (the spot trainer in the
rollout's tail, the sequential refresher after the policy update) ask, so `drafter.schedule`
means the same under either `drafter.where`.

  frozen        never after the warm-start
  every_k       RL steps k-1, 2k-1, ... (k = drafter.refresh_every)
  below_accept  the step after a rollout whose accept length fell under the bound
  payoff        when the rollout time a refresh is estimated to save exceeds what it costs

The payoff estimate uses only the run's own measurements (`PayoffInputs`): how far the rollout's
accept length has drifted below the level the last refresh reached, how many seconds the rollout
spent in its speculative tail, and the measured cost of a refresh. The tail's decode time is
taken as inversely proportional to the accept length (each target pass emits `accept_len`
tokens), so a refresh that lifts the accept length from `a` back to `a_fresh` saves
`tail_s * (1 - a / a_fresh)` per step; the drift goes on at the same rate with or without it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MIN_ACCEPT = 1.0  # a pass always emits one token: accept length never falls under 1


@dataclass(frozen=True)
class PayoffInputs:
    """One decision's measurements (seconds and accept lengths of the run itself)."""

    accept_now: float  # the last rollout's accept length (spec/accept_len/mean)
    accept_fresh: float  # the accept length of the first rollout after the last refresh (or warm-start)
    steps_since: int  # RL steps between those two rollouts
    tail_s: float  # the last rollout's seconds in its tail (rollout/time_s * rollout/tail_share)
    cost_s: float  # what one refresh costs the run (see `refresh_cost_s`)
    horizon: int  # RL steps the refresh is credited for (drafter.payoff_horizon)


def drift_per_step(accept_fresh: float, accept_now: float, steps_since: int) -> float:
    """Accept-length lost per RL step since the last refresh (0 when it has not fallen)."""
    return max(0.0, accept_fresh - accept_now) / max(1, steps_since)


def refresh_saving_s(m: PayoffInputs) -> float:
    """Rollout seconds a refresh now saves over the next `horizon` steps: with it the accept length
    restarts from `accept_fresh`, without it from `accept_now`; both keep drifting."""
    if m.accept_now >= m.accept_fresh or m.tail_s <= 0:
        return 0.0
    drift = drift_per_step(m.accept_fresh, m.accept_now, m.steps_since)
    saved = 0.0
    for t in range(1, m.horizon + 1):
        without = max(MIN_ACCEPT, m.accept_now - drift * t)
        with_refresh = max(MIN_ACCEPT, m.accept_fresh - drift * (t - 1))
        saved += m.tail_s * m.accept_now * (1.0 / without - 1.0 / with_refresh)
    return saved


def refresh_cost_s(where: str, drafter_step_s: float | None, refresh_steps: int, tail_s: float,
                   threads: int, cpus: int) -> float:
    """Seconds one refresh costs the run. Sequential: its drafter steps, each at the measured step
    time (0 before the first refresh has measured it). Spot: the trainer runs for the whole tail on
    `threads` of the `cpus` cores decoding runs on, which decoding then lacks (cpus 0: decoding
    runs on an accelerator, the spot trainer on cores it does not use: free)."""
    if where == "sequential":
        return refresh_steps * (drafter_step_s or 0.0)
    return tail_s * min(1.0, threads / cpus) if cpus > 0 else 0.0


def payoff_s(m: PayoffInputs) -> float:
    """Saving minus cost: a refresh pays when this is > 0."""
    return refresh_saving_s(m) - m.cost_s


@dataclass
class _Observed:
    accept_now: float | None = None
    accept_fresh: float | None = None
    steps_since: int = 0
    tail_s: float = 0.0
    step_s: float | None = None  # measured seconds per drafter step (sequential)
    refreshed_at: int | None = None  # a refresh not yet measured: the first rollout after this step will


class RefreshSchedule:
    """Decides per RL step whether the drafter trains (`due`) from what it was shown (`observe`)."""

    def __init__(self, cfg, cpus: int = 1):
        """cpus: the cores decoding runs on (0: it runs on an accelerator), for the spot trainer's cost."""
        self.cfg, self.cpus = cfg, cpus
        self.seen = _Observed()
        self.last_payoff: float | None = None
        self.last_decision = False

    @property
    def trains(self) -> bool:
        return self.cfg.schedule != "frozen"

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """RL step `step`'s metrics: its rollout's accept length and tail time. The first rollout after
        a refresh (spot: in an earlier step's tail; sequential: after an earlier update) sets the
        fresh level the drift is measured from."""
        s = self.seen
        accept = metrics.get("spec/accept_len/mean")
        if accept is not None:
            s.accept_now = accept
            fresh = s.refreshed_at is not None and step > s.refreshed_at
            if fresh or s.accept_fresh is None or accept > s.accept_fresh:
                s.accept_fresh, s.steps_since = accept, 0
                s.refreshed_at = None if fresh else s.refreshed_at
            else:
                s.steps_since += 1
        s.tail_s = metrics.get("rollout/time_s", 0.0) * metrics.get("rollout/tail_share", 0.0)

    def measured_refresh(self, steps: int, seconds: float) -> None:
        """A sequential refresh took `seconds` for `steps` drafter steps: the cost of the next one."""
        if steps:
            self.seen.step_s = seconds / steps

    def inputs(self) -> PayoffInputs | None:
        s, d = self.seen, self.cfg
        if s.accept_now is None or s.accept_fresh is None:
            return None
        cost = refresh_cost_s(d.where, s.step_s, d.refresh_steps, s.tail_s, d.spot_threads, self.cpus)
        return PayoffInputs(s.accept_now, s.accept_fresh, s.steps_since, s.tail_s, cost, d.payoff_horizon)

    def due(self, step: int) -> bool:
        """Whether RL step `step` trains the drafter (remembered for `metrics`)."""
        d, m = self.cfg, self.inputs()
        self.last_payoff = payoff_s(m) if m is not None else None
        if d.schedule == "every_k":
            due = (step + 1) % d.refresh_every == 0
        elif d.schedule == "below_accept":
            due = self.seen.accept_now is not None and self.seen.accept_now < d.refresh_below_accept_len
        elif d.schedule == "payoff":  # and not again before the last refresh has been measured
            due = self.last_payoff is not None and self.last_payoff > 0 and self.seen.refreshed_at is None
        else:
            due = False
        self.last_decision = due
        if due:
            self.seen.refreshed_at = step
        return due

    def metrics(self) -> dict[str, float]:
        out = {"drafter/refresh_decision": float(self.last_decision)}
        if self.last_payoff is not None:
            out["drafter/payoff_s"] = self.last_payoff
        return out

    def state_dict(self) -> dict:
        return {"seen": asdict(self.seen), "last_payoff": self.last_payoff, "last_decision": self.last_decision}

    def load_state_dict(self, state: dict) -> None:
        self.seen = _Observed(**state["seen"])
        self.last_payoff, self.last_decision = state["last_payoff"], state["last_decision"]
