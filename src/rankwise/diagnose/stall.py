"""Early stall reports: a collective that waits long is explained while the job keeps waiting.

A rank that hangs before a collective (a sleep, a deadlock in a data loader, a rank-dependent
branch) makes every other rank wait until the backend's timeout (300 s by default), and only
then is anything said. The watchdog thread calls ``check`` at every heartbeat: once a
collective has been pending for ``RANKWISE_STALL_REPORT_S`` seconds (50 by default, so that
the report is out within a minute; 0 turns the reports off), the lowest waiting rank prints
one report naming the waiting ranks, the missing ones and where they are (their call site,
or "running user code at file:line"). Nothing is
raised: the job goes on waiting, and still fails at the timeout if the stall does not end.
Each collective is reported once.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ..job import env as envmod
from . import nodes, report
from .channel import gather

_config: dict[str, float | None] = {"after_s": None}


def configure(after_s: float | None) -> None:
    """Report collectives pending for ``after_s`` seconds (0: never; None: the environment's)."""
    if after_s is not None and not after_s >= 0:
        from ..errors import ConfigError

        raise ConfigError(
            f"after_s={after_s!r} must be a number of seconds >= 0",
            fix="pass e.g. 60, or 0 to turn stall reports off.",
        )
    _config["after_s"] = after_s


def after_s() -> float:
    configured = _config["after_s"]
    return envmod.stall_report_s() if configured is None else configured


def _oldest_pending(g: Any) -> Any | None:
    for e in list(g.ring)[-8:]:
        if e.state in ("entered", "waiting"):
            return e
    return None


def check(groups: list[Any], watchdog: Any, interval: float, timeout: float) -> str | None:
    """Report the first collective pending longer than ``after_s()``; returns the report."""
    limit = after_s()
    if limit <= 0 or watchdog is None:
        return None
    now = time.time()
    for g in groups:
        e = _oldest_pending(g)
        if e is None or now - e.t0 < limit or getattr(g, "stall_reported", 0) >= e.seq:
            continue
        g.stall_reported = e.seq
        node = getattr(watchdog, "node", None)
        views = gather.collect_views(g, e.record(), watchdog.own, interval, False, node)
        msg, fix = report.stall_report(g.global_rank, e.record(), views, now - e.t0, timeout)
        missing = report.culprits(views, e.seq)
        waiting = [v.rank for v in views if v.rank not in missing]
        missed = getattr(watchdog.own, "missed", None)
        if missed:  # this node is cut off: say so from here (the others are unknown)
            msg = (f"stall: rank {g.global_rank} has been waiting in {report.describe(e.record())} "
                   f"for {now - e.t0:.0f}s. {nodes.unreachable_sentence(missed)}")  # fmt: skip
            fix = nodes.unreachable_fix(missed)
        elif waiting and g.global_rank != min(waiting):
            continue  # one report per stall, from the lowest waiting rank
        text = (
            f"rankwise: [rank {g.global_rank}] {msg}\nFix: {fix}\n"
            f"(the job keeps waiting; it fails at the timeout of {timeout:.0f}s unless the "
            "missing rank(s) arrive)"
        )
        print(text, file=sys.stderr, flush=True)
        _hang_event(g.global_rank, text)
        return text
    return None


def _hang_event(rank: int, text: str) -> None:
    """The report as a ``hang`` event of the run directory (``rankwise top``, the dashboard)."""
    from .. import timing
    from ..timing import clock, files

    folder = timing.settings_from_env()[1]
    if folder:
        c = clock.current()
        files.append_event(folder, {"step": None if c is None else c.step, "event": "hang",
                                    "text": text, "rank": rank})  # fmt: skip
