"""A schedule run on paper: deadlock, time, bubble and memory, without a process or a tensor.

``simulate(schedule, cost)`` plays every rank's action list with the given duration of each
kind of action: an action starts when its rank is free and the message it needs has been sent
(sends never block: the executor posts them asynchronously). If no rank can go on while some
still have actions, the schedule would deadlock: ``Deadlock`` names every rank's stuck action.

``peak_activations`` counts, per rank, the micro-batches whose forward graph is alive (from
``F`` to ``B``, or to ``W`` when the backward is split: the weight pass still needs the saved
tensors), in units of one virtual stage; ``stash_peak`` counts the messages a rank must set
aside because its sender sent them before the one it needs now (a channel between two ranks
is read in the order it was written).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import ConfigError
from .schedules import Action, Message, Schedule

DEFAULT_COST: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Durations of a whole stage's actions: a backward costs about two forwards, split evenly."""


class Deadlock(ConfigError):
    """The schedule cannot finish: every rank left waits for a message never sent."""


@dataclass(frozen=True)
class Timeline:
    """When each rank ran each of its actions (``spans[r][k]`` = (start, end) of action k)."""

    schedule: Schedule
    spans: tuple[tuple[tuple[float, float], ...], ...]

    @property
    def makespan(self) -> float:
        return max((end for row in self.spans for _, end in row), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(end - start for start, end in self.spans[rank])

    def idle(self, rank: int) -> float:
        """Time ``rank`` waits inside the step (before its first action, between actions,
        after its last): the rank's share of the bubble."""
        return self.makespan - self.busy(rank)

    @property
    def bubble(self) -> float:
        """Idle fraction over all ranks: ``1 - busy / (ranks x makespan)``."""
        p = self.schedule.ranks
        total = sum(self.busy(r) for r in range(p))
        return 1.0 - total / (p * self.makespan) if self.makespan else 0.0


def _dependencies(schedule: Schedule, action: Action) -> list[tuple[Action, bool]]:
    """(action, on another rank) pairs that must have finished before ``action`` starts."""
    deps = []
    if action.kind in ("B", "I"):
        deps.append((Action("F", action.stage, action.micro_batch), False))
    if action.kind == "W":
        deps.append((Action("I", action.stage, action.micro_batch), False))
    msg = schedule.needs(action)
    if msg is not None:
        kind = "F" if msg.kind == "act" else ("I" if schedule.split_backward else "B")
        deps.append((Action(kind, msg.src_stage, msg.micro_batch), True))
    return deps


def _per_kind(cost: dict[str, float], v: int) -> Callable[[Action], float]:
    return lambda action: cost[action.kind] / v


def simulate(
    schedule: Schedule,
    cost: Mapping[str, float] | Callable[[Action], float] | None = None,
    latency: float = 0.0,
) -> Timeline:
    """Play ``schedule``; a virtual stage's action lasts ``cost[kind] / stages_per_rank``, or
    ``cost(action)`` when ``cost`` is a function (durations measured action by action: the
    step a schedule would take with free communication, a run's ceiling).

    Raises ``Deadlock`` naming each rank's first action that could never start.
    """
    v = schedule.stages_per_rank
    duration = cost if callable(cost) else _per_kind(dict(DEFAULT_COST if cost is None else cost), v)
    rows = schedule.actions
    done: dict[Action, float] = {}
    spans: list[list[tuple[float, float]]] = [[] for _ in rows]
    clock = [0.0] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while len(spans[r]) < len(row):
                action = row[len(spans[r])]
                deps = _dependencies(schedule, action)
                if any(dep not in done for dep, _ in deps):
                    break
                start = max([clock[r]] + [done[d] + (latency if far else 0.0) for d, far in deps])
                end = start + duration(action)
                spans[r].append((start, end))
                done[action] = clock[r] = end
                progress = True
    stuck = [(r, row[len(spans[r])]) for r, row in enumerate(rows) if len(spans[r]) < len(row)]
    if stuck:
        where = ", ".join(f"rank {r} at {a}" for r, a in stuck)
        raise Deadlock(
            f"pipeline schedule {schedule.name!r} (ranks={schedule.ranks}, "
            f"micro_batches={schedule.micro_batches}, stages_per_rank={v}) deadlocks: {where}",
            fix="every forward must precede its backward and a stage must run micro-batches "
            "in an order its neighbours send them; use a schedule from rankwise.pipeline.schedules.",
        )
    return Timeline(schedule, tuple(tuple(row) for row in spans))


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the most micro-batch x virtual-stage forward graphs alive at once."""
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for action in row:
            live += {"F": 1, "B": -1, "W": -1}.get(action.kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def stash_peak(schedule: Schedule) -> list[int]:
    """Per rank, the most messages received ahead of need (read in their sender's order)."""
    peaks = []
    for me, row in enumerate(schedule.actions):
        channels = {src: schedule.sends(src, me) for src in range(schedule.ranks) if src != me}
        read = {src: 0 for src in channels}
        stash: set[Message] = set()
        peak = 0
        for action in row:
            msg = schedule.needs(action)
            if msg is None or schedule.rank_of(msg.src_stage) == me:
                continue
            src = schedule.rank_of(msg.src_stage)
            while msg not in stash:
                stash.add(channels[src][read[src]])
                read[src] += 1
            peak = max(peak, len(stash) - 1)
            stash.discard(msg)
        peaks.append(peak)
    return peaks


def check(schedule: Schedule) -> Timeline:
    """The properties every schedule must have, or a ``ConfigError`` saying which fails:
    each rank runs exactly the actions of its stages once, each forward before its backward,
    and the schedule finishes (``simulate``)."""
    for r, row in enumerate(schedule.actions):
        kinds = {"I", "W"} if schedule.split_backward else {"B"}
        want = {Action(k, s, i) for s in schedule.stages_of(r)
                for i in range(schedule.micro_batches) for k in kinds | {"F"}}  # fmt: skip
        if len(row) != len(set(row)) or set(row) != want:
            raise ConfigError(
                f"pipeline schedule {schedule.name!r}: rank {r} does not run each of its "
                "actions exactly once",
                fix="build schedules with rankwise.pipeline.schedules.",
            )
    return simulate(schedule)
