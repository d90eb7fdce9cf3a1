"""Goodput by seeded Monte Carlo: failures drawn, each one replayed on a ``Timeline``.

The same rules as ``closed_form`` states them, event by event, with nothing averaged: a failure
loses the segment in progress and starts a recovery (one in progress starts again); under
shrink-and-continue the failed host is away for a while, the others run at (hosts - away) /
hosts of the speed, and its return costs a grow-back pause. ``replay`` runs a given list of
failures (the namespace cluster's measured kill) through the same ``Timeline``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...errors import ConfigError
from .policies import Plan

HARDWARE, SOFTWARE = 0, 1


@dataclass
class Timeline:
    """One run of ``plan``: wall time ``t``, progress ``p`` since the last recovery (progress
    seconds, saves included), work banked at failures, and the hosts away."""

    plan: Plan
    t: float = 0.0
    p: float = 0.0
    banked: float = 0.0
    down_until: float = 0.0
    away: list[float] = field(default_factory=list)

    def speed(self) -> float:
        plan = self.plan
        return (plan.hosts - len(self.away)) / plan.hosts / (1.0 + plan.overhead)

    def advance(self, until: float) -> None:
        """Run to wall time ``until``: progress, pauses and returning hosts on the way."""
        while self.t < until:
            if self.t < self.down_until:
                self.t = min(self.down_until, until)
                continue
            back = min(self.away, default=math.inf)
            if back <= self.t:  # came back while the job was down: it joins now
                self.away.remove(back)
                self.down_until = self.t + self.plan.grow_back_s
                continue
            stop = min(back, until)
            self.p += (stop - self.t) * self.speed()
            self.t = stop

    def _durable(self) -> float:
        """Work in the completed segments since the last recovery."""
        plan = self.plan
        return math.floor(self.p / (plan.tau + plan.delta) + 1e-12) * plan.tau

    def fail(self, kind: int) -> None:
        """A failure now: the segment in progress is lost; recovery starts (again)."""
        self.banked += self._durable()
        self.p = 0.0
        self.down_until = self.t + self.plan.recover_s[kind]
        if self.plan.name == "shrink":
            self.away.append(self.t + self.plan.away_s[kind])

    def work(self) -> float:
        """Work done: banked, durable, and the current segment's work so far."""
        plan = self.plan
        rest = self.p - self._durable() / plan.tau * (plan.tau + plan.delta)
        return self.banked + self._durable() + min(max(rest, 0.0), plan.tau)


@dataclass(frozen=True)
class Estimate:
    """A Monte Carlo mean and its standard error over the trials."""

    mean: float
    stderr: float
    trials: int


def simulate(plan: Plan, *, horizon_s: float, trials: int, seed: int) -> Estimate:
    """Goodput (work / wall time) of ``plan`` over ``trials`` runs of ``horizon_s`` seconds,
    failures drawn from ``seed``: the same seed, the same answer."""
    if not (trials >= 1 and horizon_s > 0 and math.isfinite(horizon_s)):
        raise ConfigError(f"goodput simulate: trials={trials!r}, horizon_s={horizon_s!r}",
                          fix="pass trials >= 1 and a finite horizon_s > 0")  # fmt: skip
    import numpy as np  # here: the `rankwise` command's parser imports this package

    rng = np.random.default_rng(seed)
    out = np.empty(trials)
    for i in range(trials):
        n = rng.poisson(plan.rate * horizon_s)
        times = np.sort(rng.uniform(0.0, horizon_s, n))
        kinds = np.where(rng.random(n) < plan.hardware_fraction, HARDWARE, SOFTWARE)
        line = Timeline(plan)
        for t, kind in zip(times.tolist(), kinds.tolist(), strict=True):
            line.advance(t)
            line.fail(kind)
        line.advance(horizon_s)
        out[i] = line.work() / horizon_s
    err = float(out.std(ddof=1) / math.sqrt(trials)) if trials > 1 else math.inf
    return Estimate(float(out.mean()), err, trials)


def replay(plan: Plan, work_s: float, failures: list[tuple[float, int]]) -> float:
    """Wall seconds until ``work_s`` of work is done, given failures at (wall second, kind)."""

    def work_at(t: float) -> float:
        line = Timeline(plan)
        for when, kind in failures:
            if when >= t:
                break
            line.advance(when)
            line.fail(kind)
        line.advance(t)
        return line.work()

    low, high = 0.0, work_s * (1.0 + plan.overhead) + 1.0
    while work_at(high) < work_s:
        high *= 2.0
    for _ in range(60):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if work_at(mid) < work_s else (low, mid)
    return high
