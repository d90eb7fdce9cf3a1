"""Robust statistics of the straggler attribution: peer medians, each rank's expected record
(its peers', or its own past), and how noisy a job is.

Pure functions of floats (no torch), fast enough for a record of thousands of ranks.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


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


def busy(r: dict[str, float]) -> float:
    """Seconds of the step this rank spent not waiting in a collective: its arrival time at
    the step's syncs. The straggler has the largest; wall times (``total``) are all equal."""
    return max(0.0, r["total"] - r["blocked"])


KEYS = ("data", "compute", "busy", "ratio", "cpu")


def expectations(ranks: list[dict[str, float]], own: dict[int, deque]) -> list[dict | None]:
    """Each rank's expected parts: its peers' medians (same role), else its own baseline."""
    table = [parts(r) for r in ranks]
    groups: dict[float, list[int]] = {}
    for i, r in enumerate(ranks):
        groups.setdefault(r["role"], []).append(i)
    out: list[dict | None] = [None] * len(ranks)
    for members in groups.values():
        if len(members) > 1:
            cols = {k: medians_without_each([table[j][k] for j in members]) for k in KEYS}
            for n, j in enumerate(members):
                out[j] = {k: cols[k][n] for k in KEYS}
            continue
        mine = [parts(r) for r in own.get(members[0], ())]
        if len(mine) >= 3:
            out[members[0]] = {k: _median([x[k] for x in mine if k in ("data", "compute", "busy")
                                           or x["cpu"] >= 0]) for k in KEYS}  # fmt: skip
    return out


def _median(values: list[float]) -> float:
    """The median; -1 (unknown, as a record's ``cpu``) of none."""
    return statistics.median(values) if values else -1.0


def ratio(r: dict[str, float]) -> float:
    """CPU seconds per busy second (-1 or less: no CPU seconds read in the record)."""
    return r["cpu"] / max(busy(r), 1e-9)


def parts(r: dict[str, float]) -> dict[str, float]:
    """What a rank's record is compared on (``KEYS``)."""
    return {"data": r["data"], "compute": r["forward"] + r["backward"], "busy": busy(r),
            "ratio": ratio(r), "cpu": r["cpu"]}  # fmt: skip
