"""The web page's curves: a run's records binned to at most ``MAX_POINTS`` points per curve.

A long run holds thousands of records; drawn one by one, a page of eight ranks' stacked phases
weighs megabytes and takes the launcher's CPU from the workers. Consecutive records are
grouped, and each group gives one point: the mean of each phase (a slow phase shows as a
raised mean, not a missed spike), the peak memory (what runs out), and the throughput between
the groups' ends (step numbers over clock time: exact whatever the grouping).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .records import PHASES, Step
from .summary import throughput_series

MAX_POINTS = 150


def bins(steps: Sequence[Step], n: int = MAX_POINTS) -> list[Sequence[Step]]:
    """Consecutive groups of records, at most ``n`` of them."""
    k = max(1, math.ceil(len(steps) / n))
    return [steps[i:i + k] for i in range(0, len(steps), k)]


@dataclass(frozen=True)
class RankCurve:
    """One rank's points: the last step of each group, each phase's mean in ms, peak MiB."""

    steps: list[int]
    phases_ms: dict[str, list[float]]
    mem_mib: list[float | None]


def rank_curve(groups: Sequence[Sequence[Step]], rank: int) -> RankCurve:
    xs: list[int] = []
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    mem: list[float | None] = []
    for group in groups:
        entries = [r for s in group for r in s.ranks if r.rank == rank]
        if not entries:
            continue
        xs.append(group[-1].step)
        for p in PHASES:
            phases[p].append(1000 * sum(r.phases[p] for r in entries) / len(entries))
        known = [r.mem for r in entries if r.mem is not None]
        mem.append(max(known) / 2**20 if known else None)
    return RankCurve(xs, phases, mem)


def throughput_curve(groups: Sequence[Sequence[Step]]) -> list[tuple[int, float]]:
    """(step, steps per second since the previous group's end)."""
    return throughput_series([g[-1] for g in groups])


def step_time_curve(groups: Sequence[Sequence[Step]]) -> list[tuple[int, float]]:
    """(step, mean ms per step of the group: each step as long as its slowest rank)."""
    out = []
    for group in groups:
        totals = [max(r.total for r in s.ranks) for s in group if s.ranks]
        if totals:
            out.append((group[-1].step, 1000 * sum(totals) / len(totals)))
    return out
