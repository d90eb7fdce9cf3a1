"""Robust statistics of the straggler attribution: peer medians, and how noisy a job is.

Pure functions of floats (no torch), fast enough for a record of thousands of ranks.
"""

from __future__ import annotations

import math
import statistics


def medians_without_each(values: list[float]) -> list[float]:
    """For each i, the median of ``values`` without ``values[i]`` (one sort: O(n log n), so a
    record of thousands of ranks is attributed in milliseconds)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    where = {i: p for p, i in enumerate(order)}
    ranked = [values[i] for i in order]
    m = len(values) - 1

    def rest(p: int, k: int) -> float:  # the k-th smallest once position p is taken out
        return ranked[k] if k < p else ranked[k + 1]

    out = []
    for i in range(len(values)):
        p = where[i]
        mid = rest(p, m // 2) if m % 2 else (rest(p, m // 2 - 1) + rest(p, m // 2)) / 2
        out.append(mid)
    return out


def noise(series: list[list[float]], steps: list[float]) -> tuple[float, float]:
    """How much each series (a rank's excess record after record; the job's communication)
    varies over time: 1.4826 median absolute deviations from its own median, pooled (a standard
    deviation where they are normal, unmoved by a few outliers; a constant offset is no noise);
    and the steps its records usually cover (``scaled``)."""
    devs = []
    for values in filter(None, series):
        mid = statistics.median(values)
        devs += [abs(v - mid) for v in values]
    if not devs or not steps:
        return 0.0, 1.0
    return statistics.median(devs) * 1.4826, statistics.median(steps)


def scaled(noise: tuple[float, float], now: float) -> float:
    """The noise of a record of ``now`` steps: up to twice more for fewer steps than usual (a
    dense record is one step, not ten; more would keep a real straggler's dense records under
    the bar)."""
    spread, usual = noise
    return spread * min(2.0, max(1.0, math.sqrt(usual / max(now, 1.0))))


def sample(world: int) -> list[int]:
    """The ranks whose excess series stand for the job's noise (32 at most, spread out)."""
    return list(range(0, world, max(1, world // 32)))[:32]
