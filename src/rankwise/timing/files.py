"""The run directory's timing files, written by rank 0, one JSON object per line, flushed.

``steps.jsonl``: one object per record, ``{"step", "t", "world", "strategy", "ranks": [...],
"straggler"}``, each rank's row in seconds (``data``, ``forward``, ``backward``, ``comm``,
``wait``, ``wait_for``, ``optimizer``, ``checkpoint``, ``other``, ``total``) and bytes (``mem``),
plus ``busy``, ``cpu``, ``lag``, ``ready_lag``, ``steps`` (the steps the record averages);
``straggler``: null or the named straggler (``rank``, ``node``, ``kind``, ``cost_ms``,
``since_step``, ``chronic``, plus ``scope``, ``why``, ``step_ms``).
``events.jsonl``: ``{"t", "step", "event": "straggler"|"straggler_gone"|"hang", "text"}``
plus the straggler's fields. ``run.json``: what the job is (world, strategy, cadence, start).
Readers (``rankwise top``, the dashboard) treat every line as untrusted data.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Straggler:
    """A named straggler as ``steps.jsonl`` holds it (``fields()``; the dashboard reads it back)."""

    rank: int
    node: int
    kind: str
    cost_ms: float
    since_step: int
    chronic: bool
    scope: str = "rank"
    """``rank``, or ``node`` when every rank of ``node`` is slow (``rank`` is its first)."""
    why: str = ""
    step_ms: float = 0.0
    """The job's step now (ms); without the straggler it would take ``step_ms - cost_ms``."""

    def fields(self) -> dict[str, Any]:
        return asdict(self)

STEPS, EVENTS, RUN = "steps.jsonl", "events.jsonl", "run.json"


class RunFiles:
    """Appends to ``steps.jsonl`` and ``events.jsonl`` in ``folder`` (created)."""

    def __init__(self, folder: str | Path, run: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / RUN).write_text(json.dumps({**run, "started": time.time()}) + "\n")
        self._steps = open(self.folder / STEPS, "a", buffering=1)  # noqa: SIM115 (kept open)
        self._events = open(self.folder / EVENTS, "a", buffering=1)  # noqa: SIM115

    def step(self, record: dict[str, Any]) -> None:
        self._steps.write(json.dumps(record, allow_nan=False) + "\n")
        self._steps.flush()

    def event(self, event: dict[str, Any]) -> None:
        self._events.write(json.dumps({"t": time.time(), **event}, allow_nan=False) + "\n")
        self._events.flush()

    def close(self) -> None:
        self._steps.close()
        self._events.close()


def append_event(folder: str | Path, event: dict[str, Any]) -> None:
    """One event into ``folder``'s ``events.jsonl`` from any rank (a hang report: the rank that
    writes it may not be rank 0); one short append, never raises."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / EVENTS, "a") as f:
            f.write(json.dumps({"t": time.time(), **event}, default=str) + "\n")
    except OSError:
        pass


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a timing file (a line being written is left out)."""
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out
