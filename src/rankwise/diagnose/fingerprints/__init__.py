"""Collective fingerprints: what each rank issued, checked across ranks, explained on failure.

Hot path of ``record`` (every collective rankwise issues): a signature lookup (cached per
op/shape/dtype), a rolling hash, the user's call site (a walk up ``f_back`` to the first frame
outside rankwise and torch), a ring-buffer append and one TCPStore ``set`` (no reply awaited).
A few microseconds (``benchmarks/diagnostics.py``). Agreement checks all-gather
``(seq, rolling hash)`` before the collective exchanges data. The rolling hash covers every
collective so far, so a check also vouches for all unchecked ones before it. Checked: each of
the first ``check_first`` collectives, then every ``check_every``-th, and every call that passes
``check=True`` (the user-level helpers in ``rankwise.comm.collectives``).

By concept: ``settings`` (what is checked), ``state`` (the one process-wide ``STATE``),
``entry`` (one collective, and its diagnosis), ``recording`` (record and check), ``watch``
(the side channel and the watchdog of the world group).
"""

from __future__ import annotations

from .entry import Entry, failure
from .recording import (
    collective,
    configure,
    last_report,
    recent,
    record,
    reset,
    settings,
    verify,
)
from .settings import Settings
from .state import STATE
from .watch import blocked, watch_world

__all__ = [
    "STATE",
    "Entry",
    "Settings",
    "blocked",
    "collective",
    "configure",
    "failure",
    "last_report",
    "recent",
    "record",
    "reset",
    "settings",
    "verify",
    "watch_world",
]
