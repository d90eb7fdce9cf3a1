"""Reading a run directory's ``steps.jsonl`` and ``events.jsonl`` while the job writes them.

The engines append one JSON object per recorded step (and one per straggler or hang event);
a reader polls. ``JsonlTail`` remembers how far it has read and takes only whole lines: a last
line still being written is left for the next poll (unless it already parses: the writer's
newline has not landed yet), a file replaced or truncated (a restarted job) is read again from
the start. The files are untrusted data: ``json.loads`` only, and a line that is not the
contract's shape (see ``timing/``'s writer) is skipped and counted, never raised.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..timing.files import EVENTS as EVENTS_FILE
from ..timing.files import STEPS as STEPS_FILE
from ..timing.files import Straggler

PHASES: tuple[str, ...] = (
    "data", "forward", "backward", "comm", "wait", "optimizer", "checkpoint", "other",
)
"""The parts of one step, in the order bars and plots stack them."""
KINDS: tuple[str, ...] = ("input", "compute", "communication", "host")


@dataclass(frozen=True)
class RankStep:
    """One rank's share of one recorded step (seconds; ``mem`` in bytes or None)."""

    rank: int
    node: int
    phases: dict[str, float]
    wait_for: int | None
    total: float
    mem: int | None


@dataclass(frozen=True)
class Step:
    """One recorded step of the whole job."""

    step: int
    t: float
    world: int
    strategy: str
    ranks: tuple[RankStep, ...]
    straggler: Straggler | None


@dataclass(frozen=True)
class Event:
    """A straggler named or gone, or a hang diagnosed (``text`` is the diagnosis)."""

    t: float
    step: int | None
    event: str
    text: str


def _num(value: Any) -> float:
    # bool is an int in Python, never a duration; NaN and inf are not times either.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(value)
    return float(value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(value)
    return value


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def rank_step(obj: dict[str, Any]) -> RankStep:
    """One entry of a step's ``ranks``; ValueError/TypeError/KeyError when malformed."""
    phases = {p: _num(obj.get(p, 0.0)) for p in PHASES}
    total = _num(obj["total"]) if "total" in obj else sum(phases.values())
    return RankStep(
        rank=_int(obj["rank"]),
        node=_int(obj.get("node", 0)),
        phases=phases,
        wait_for=_opt_int(obj.get("wait_for")),
        total=total,
        mem=_opt_int(obj.get("mem")),
    )


def straggler(obj: Any) -> Straggler | None:
    if obj is None:
        return None
    kind = str(obj["kind"])
    if kind not in KINDS:
        raise ValueError(kind)
    return Straggler(
        rank=_int(obj["rank"]),
        node=_int(obj.get("node", 0)),
        kind=kind,
        cost_ms=_num(obj.get("cost_ms", 0.0)),
        since_step=_int(obj.get("since_step", 0)),
        chronic=bool(obj.get("chronic", False)),
        scope="node" if obj.get("scope") == "node" else "rank",
        why=str(obj.get("why") or ""),
        step_ms=_num(obj.get("step_ms", 0.0)),
    )


def step(obj: dict[str, Any]) -> Step:
    """One line of ``steps.jsonl``; ValueError/TypeError/KeyError when malformed."""
    ranks = tuple(sorted((rank_step(r) for r in obj["ranks"]), key=lambda r: r.rank))
    return Step(
        step=_int(obj["step"]),
        t=_num(obj["t"]),
        world=_int(obj.get("world", len(ranks))),
        strategy=str(obj.get("strategy", "")),
        ranks=ranks,
        straggler=straggler(obj.get("straggler")),
    )


def event(obj: dict[str, Any]) -> Event:
    """One line of ``events.jsonl``; ValueError/TypeError/KeyError when malformed."""
    return Event(
        t=_num(obj["t"]),
        step=_opt_int(obj.get("step")),
        event=str(obj["event"]),
        text=str(obj.get("text", "")),
    )


class JsonlTail:
    """The objects appended to one JSON-lines file since the last ``read()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.skipped = 0
        self._identity: tuple[int, int] | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fp:
                st = os.fstat(fp.fileno())
                if (st.st_dev, st.st_ino) != self._identity or st.st_size < self.offset:
                    self._identity, self.offset = (st.st_dev, st.st_ino), 0  # new or truncated
                fp.seek(self.offset)
                data = fp.read()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        whole, last = lines[:-1], lines[-1]
        self.offset += len(data) - len(last)
        out = [obj for obj in map(self._parse, whole) if obj is not None]
        if last.strip():
            obj = self._parse(last, partial=True)
            if obj is not None:  # complete already: its newline is still to come
                self.offset += len(last)
                out.append(obj)
        return out

    def _parse(self, line: bytes, partial: bool = False) -> dict[str, Any] | None:
        if not line.strip():
            return None
        try:
            obj = json.loads(line)
        except ValueError:  # includes UnicodeDecodeError
            self.skipped += 0 if partial else 1
            return None
        if not isinstance(obj, dict):
            self.skipped += 0 if partial else 1
            return None
        return obj


class RunView:
    """What a reader knows of a run: the last ``window`` steps and events, updated by
    ``poll()``."""

    def __init__(self, run_dir: str | os.PathLike[str], window: int = 2000) -> None:
        self.run_dir = Path(run_dir)
        self.steps: deque[Step] = deque(maxlen=window)
        self.events: deque[Event] = deque(maxlen=window)
        self._steps = JsonlTail(self.run_dir / STEPS_FILE)
        self._events = JsonlTail(self.run_dir / EVENTS_FILE)
        self._bad = 0
        self.version = 0
        """Counts the records taken in: a view redraws when it changed."""

    @property
    def skipped(self) -> int:
        """Lines that were not the contract's shape (not JSON, or missing or mistyped fields)."""
        return self._steps.skipped + self._events.skipped + self._bad

    @property
    def started(self) -> bool:
        return (self.run_dir / STEPS_FILE).exists() or (self.run_dir / EVENTS_FILE).exists()

    def poll(self) -> bool:
        """Read what was appended; True when anything new arrived."""
        before = self.version
        for obj in self._steps.read():
            self._add(self.steps, step, obj)
        for obj in self._events.read():
            self._add(self.events, event, obj)
        return self.version != before

    def _add(self, into: deque, parse: Any, obj: dict[str, Any]) -> None:
        try:
            into.append(parse(obj))
        except (ValueError, TypeError, KeyError, AttributeError):
            self._bad += 1
        else:
            self.version += 1
