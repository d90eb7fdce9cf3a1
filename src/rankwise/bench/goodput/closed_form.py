"""Goodput in closed form, and the classic optimal checkpoint interval (Young 1974, Daly 2006).

Failures arrive as a Poisson process of rate ``L`` (the job's). A segment of ``tau`` work plus
``delta`` save takes ``S = (tau + delta) (1 + overhead)`` seconds of wall time when nothing
fails (``overhead``: the time the replication and the kept disk saves add to each second of
work, as measured: benchmarks/recovery.py's step time with copies over a plain one, less 1). A failure loses the segment in progress, then a recovery of ``R`` seconds follows; a
failure during a recovery starts it again (with that failure's kind). The expected wall time of
one segment is then ``(exp(L S) - 1) (1/L + E[R])``, exact for this model, and the goodput (work
done per wall second) is ``tau`` over it. Shrink-and-continue's slower running while a host is
away counts as ``away / hosts`` more seconds of recovery, and its grow-back pause as recovery
too: first order in ``L * away``, which the Monte Carlo (``montecarlo``) checks.
"""

from __future__ import annotations

import math

from .policies import Plan


def recovery_s(plan: Plan) -> tuple[float, float]:
    """Seconds of full-speed progress a (hardware, software) failure costs besides lost work."""
    hw, sw = plan.recover_s
    if plan.name != "shrink":
        return hw, sw
    away_hw, away_sw = plan.away_s
    return (hw + plan.grow_back_s + away_hw / plan.hosts, sw + plan.grow_back_s + away_sw / plan.hosts)


def expected_recovery_s(plan: Plan) -> float:
    """E[R]: the mean recovery, failures during it restarting it."""
    rate, p = plan.rate, plan.hardware_fraction
    if rate == 0.0:
        hw, sw = recovery_s(plan)
        return p * hw + (1 - p) * sw
    kinds = list(zip((p, 1.0 - p), recovery_s(plan), strict=True))
    survive = sum(w * math.exp(-rate * r) for w, r in kinds)
    spent = sum(w * -math.expm1(-rate * r) / rate for w, r in kinds)
    return spent / survive


def segment_wall_s(plan: Plan) -> float:
    """One segment's wall time when nothing fails."""
    return (plan.tau + plan.delta) * (1.0 + plan.overhead)


def goodput(plan: Plan) -> float:
    """Work per wall second, 0..1 (1: nothing saved, nothing failed)."""
    wall = segment_wall_s(plan)
    if plan.rate == 0.0:
        return plan.tau / wall
    expected = math.expm1(plan.rate * wall) * (1.0 / plan.rate + expected_recovery_s(plan))
    return plan.tau / expected


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimum: sqrt(2 * save * MTBF)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006): sqrt(2 d M) (1 + sqrt(d/2M)/3 + (d/2M)/9) - d for a
    save of ``d`` seconds shorter than twice the MTBF ``M``; the MTBF itself otherwise."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return young_interval_s(save_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def best_interval_s(loss, low: float, high: float, points: int = 400) -> float:
    """The interval in [low, high] (log-spaced) where ``loss(interval)`` is least."""
    ratio = (high / low) ** (1.0 / (points - 1))
    return min((low * ratio**i for i in range(points)), key=loss)
