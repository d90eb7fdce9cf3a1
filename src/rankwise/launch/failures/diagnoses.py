"""What the ranks' diagnoses left for the launcher in ``RANKWISE_DIAG_DIR``: ``rank<r>.txt``
(the diagnosis, quoted in the summary) and ``rank<r>.json`` (the ranks it blames, those that
had finished or raised, the cause it found), written by ``rankwise.diagnose.channel.gather``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def _facts(folder: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(rank, facts) of every ``rank<r>.json`` a diagnosing rank wrote (others skipped)."""
    import json

    for path in sorted(Path(folder).glob("rank*.json")) if Path(folder).is_dir() else []:
        digits = path.stem[len("rank") :]
        try:
            facts = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if digits.isdigit() and isinstance(facts, dict):
            yield int(digits), facts


def _ints(value: object) -> list[int]:
    return [r for r in value if type(r) is int] if isinstance(value, list) else []


def read_culprits(folder: str | os.PathLike) -> dict[int, list[int]]:
    """The ``rank<r>.json`` blame records that ranks wrote beside their diagnoses, by rank."""
    return {rank: _ints(facts.get("culprits")) for rank, facts in _facts(folder)}


def read_finished(folder: str | os.PathLike) -> list[int]:
    """Ranks that a diagnosis found already finished normally (``rank<r>.json``)."""
    return sorted({r for _, facts in _facts(folder) for r in _ints(facts.get("finished"))})


def read_raised(folder: str | os.PathLike) -> dict[int, str]:
    """Ranks that a diagnosis found had raised, with their exception (``rank<r>.json``)."""
    found: dict[int, str] = {}
    for _, facts in _facts(folder):
        raised = facts.get("raised")
        for rank, error in raised.items() if isinstance(raised, dict) else ():
            if str(rank).isdigit() and isinstance(error, str):
                found.setdefault(int(rank), error)
    return found


def read_causes(folder: str | os.PathLike) -> dict[int, tuple[str, list[int]]]:
    """What each diagnosis found (``rank<r>.json``): the cause's tag ('uneven', 'batch', ...)
    and the ranks it names, by the rank that diagnosed it."""
    found = {}
    for rank, facts in _facts(folder):
        cause = facts.get("cause")
        if isinstance(cause, dict) and isinstance(cause.get("tag"), str):
            found[rank] = (cause["tag"], _ints(cause.get("ranks")))
    return found


def read_stalled(folder: str | os.PathLike) -> dict[int, str]:
    """Headlines that ranks a stall report named as missing left (``rank<r>.json``'s
    ``stalled``: the collective they never reached and where they were), by rank."""
    from ...output.console import printable

    return {rank: printable(facts["stalled"], 800) for rank, facts in _facts(folder)
            if isinstance(facts.get("stalled"), str)}  # fmt: skip


def read_diagnoses(folder: str | os.PathLike) -> dict[int, str]:
    """The ``rank<r>.txt`` diagnoses that ranks wrote (``rankwise.diagnose``), by rank."""
    found: dict[int, str] = {}
    for path in sorted(Path(folder).glob("rank*.txt")) if Path(folder).is_dir() else []:
        digits = path.stem[len("rank") :]
        if digits.isdigit():
            found[int(digits)] = path.read_text(encoding="utf-8", errors="replace").strip()
    return found
