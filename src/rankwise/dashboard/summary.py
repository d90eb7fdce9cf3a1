"""What both views show, computed once from a ``RunView``: each rank's mean step anatomy over
the last steps, throughput, memory, the straggler and a hang.

Pure functions of the records: the terminal view (``terminal``) and the web page (``page``,
``plots``) only draw what these return.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .records import PHASES, Event, RunView, Step, Straggler

KIND_WORDS = {
    "input": "input (its data loading)",
    "compute": "compute (its forward/backward)",
    "communication": "communication (its link)",
    "host": "host (its machine: CPU, memory)",
}


@dataclass(frozen=True)
class RankSummary:
    """One rank over the window: mean seconds per phase and per step, the rank it waited
    for most often, its latest memory (bytes or None)."""

    rank: int
    node: int
    phases: dict[str, float]
    total: float
    wait_for: int | None
    mem: int | None


@dataclass(frozen=True)
class Summary:
    run_dir: str
    step: int | None
    world: int
    strategy: str
    steps_per_s: float | None
    step_s: float | None
    ranks: tuple[RankSummary, ...]
    straggler: Straggler | None
    hang: Event | None
    events: tuple[Event, ...]
    skipped: int
    age_s: float | None
    """Seconds since the last record was written (None before the first)."""


def rank_summaries(steps: Sequence[Step]) -> tuple[RankSummary, ...]:
    """Mean anatomy per rank over ``steps`` (a rank missing from some records is averaged
    over the records that hold it)."""
    acc: dict[int, list] = {}
    for s in steps:
        for r in s.ranks:
            entry = acc.setdefault(r.rank, [r.node, Counter(), 0.0, Counter(), None, 0])
            entry[1].update(r.phases)
            entry[2] += r.total
            if r.wait_for is not None:
                entry[3][r.wait_for] += 1
            entry[4] = r.mem if r.mem is not None else entry[4]
            entry[5] += 1
    out = []
    for rank, (node, phases, total, waits, mem, n) in sorted(acc.items()):
        out.append(RankSummary(
            rank=rank,
            node=node,
            phases={p: phases[p] / n for p in PHASES},
            total=total / n,
            wait_for=waits.most_common(1)[0][0] if waits else None,
            mem=mem,
        ))
    return tuple(out)


def steps_per_second(steps: Sequence[Step]) -> float | None:
    """Training steps per second between the first and last record (records may be every
    k-th step: the step numbers, not the record count, say how far the job went)."""
    if len(steps) < 2 or steps[-1].t <= steps[0].t:
        return None
    return (steps[-1].step - steps[0].step) / (steps[-1].t - steps[0].t)


def mean_step_s(steps: Sequence[Step]) -> float | None:
    """Mean seconds per step: each step lasts as long as its slowest rank."""
    totals = [max(r.total for r in s.ranks) for s in steps if s.ranks]
    return sum(totals) / len(totals) if totals else None


def throughput_series(steps: Sequence[Step]) -> list[tuple[int, float]]:
    """(step, steps per second since the previous record) for each record after the first."""
    out = []
    for a, b in itertools.pairwise(steps):
        if b.t > a.t and b.step > a.step:
            out.append((b.step, (b.step - a.step) / (b.t - a.t)))
    return out


def current_hang(view: RunView) -> Event | None:
    """The last hang diagnosed, unless steps were recorded after it (the job moved on)."""
    hangs = [e for e in view.events if e.event == "hang"]
    if not hangs:
        return None
    last_step_t = view.steps[-1].t if view.steps else float("-inf")
    return hangs[-1] if hangs[-1].t >= last_step_t else None


def summarize(view: RunView, last: int = 20, now: float | None = None) -> Summary:
    """The numbers of one frame: means over the ``last`` records."""
    steps = list(view.steps)[-last:]
    latest = steps[-1] if steps else None
    t_last = max([s.t for s in steps[-1:]] + [e.t for e in list(view.events)[-1:]], default=None)
    return Summary(
        run_dir=str(view.run_dir),
        step=latest.step if latest else None,
        world=latest.world if latest else 0,
        strategy=latest.strategy if latest else "",
        steps_per_s=steps_per_second(steps),
        step_s=mean_step_s(steps),
        ranks=rank_summaries(steps),
        straggler=latest.straggler if latest else None,
        hang=current_hang(view),
        events=tuple(view.events)[-20:],
        skipped=view.skipped,
        age_s=None if t_last is None else max(0.0, (now or time.time()) - t_last),
    )


def straggler_line(s: Straggler | None) -> str:
    """One sentence naming the straggler, its kind and its cost, or saying there is none."""
    if s is None:
        return "no straggler: every rank arrives together"
    how = "chronic" if s.chronic else "one-off"
    who = (f"node {s.node} (ranks from {s.rank})" if s.scope == "node"
           else f"rank {s.rank} (node {s.node})")
    why = f" [{s.why}]" if s.why else ""
    return (
        f"straggler: {who}, {KIND_WORDS.get(s.kind, s.kind)}{why}, since step "
        f"{s.since_step}, {how}; the job would step {s.cost_ms:.1f} ms faster without it"
    )


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def human_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"
