"""Stalls in ``torch.distributed`` collectives that user code calls directly (not through rankwise).

Fingerprints see only the collectives rankwise issues. A script that calls ``dist.all_reduce``
on one rank and ``dist.recv`` (or nothing) on another waits for the backend's timeout (300 s)
and then reads gloo's "Timed out"; ``--debug`` (torch's per-collective checks) catches it at
the cost of an extra collective each time. Here the watchdog's heartbeat, which already samples
where the main thread is, also notes when it is inside a ``torch.distributed`` collective called
from user code (the op, its call site, since when). Once one has waited ``stall.after_s()``
seconds (50 by default: within a minute), the lowest such rank prints a report from every
rank's heartbeat: which collective each rank is in, or the user code it is running. No
collective is added. When every rank is blocked in such a call and the calls differ (an
``all_reduce`` on one rank, a ``recv`` or a ``broadcast`` on another), none of them can ever
return: every rank then ends (exit code 1) instead of waiting for the timeout, the lowest one
leaving the report where ``rankwise run`` quotes it. Otherwise the job goes on waiting.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NamedTuple

import torch

from .frames import internal
from .records import Site

TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
C10D = os.path.join(TORCH, "distributed") + os.sep
RANKWISE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
OPS = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
        "all_to_all_single", "barrier", "monitored_barrier", "broadcast",
        "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
        "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
        "send_object_list", "recv_object_list",
    }
)  # fmt: skip
"""``torch.distributed`` functions that wait for other ranks."""


PIPELINE_WAIT = (os.path.join(RANKWISE, "pipeline", "execution", "p2p.py"), "_wait")
"""Where a pipeline stage waits for its peer's activations or gradients (a point-to-point
receive no fingerprint records): watched as a raw ``recv`` from the user's call site."""


def find(frame: Any) -> tuple[str, Site, int] | None:
    """(op, user call site, id of the op's frame) when ``frame``'s stack is inside a
    ``torch.distributed`` collective called by user code, or a pipeline stage's receive;
    None otherwise (rankwise's own collectives are fingerprinted, and reported by ``stall``)."""
    op_frame, op, through_rankwise = None, "", False
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(TORCH):  # torch's own callers (its DDP) are not the site
            if code.co_filename.startswith(C10D) and code.co_name in OPS and not through_rankwise:
                op_frame, op = frame, code.co_name  # the outermost: all_gather_object, ...
        elif (code.co_filename, code.co_name) == PIPELINE_WAIT:
            op_frame, op, through_rankwise = frame, "recv", True
        elif op_frame is not None:
            if code.co_filename.startswith(RANKWISE):
                if not through_rankwise:
                    return None
            elif not internal(code.co_filename, ("<frozen",)):  # not contextlib, functools...
                site = Site(code.co_filename, frame.f_lineno, code.co_name)
                return op, site, id(op_frame)
        frame = frame.f_back
    return None


class Tracker:
    """Remembers since when the main thread has been in the same raw collective call."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._since = 0.0
        self.reported: float | None = None

    def sample(self, main_ident: int | None) -> list | None:
        """``[op, file, line, func, since]`` for the heartbeat, or None."""
        found = find(sys._current_frames().get(main_ident)) if main_ident else None
        if found is None:
            self._key = None
            return None
        op, site, frame_id = found
        key = (frame_id, op, site.file, site.line)
        if key != self._key:
            self._key, self._since = key, time.time()
        return [op, site.file, site.line, site.func, self._since]


def _pending(state: dict[str, Any] | None) -> Any | None:
    """The rankwise collective ``state``'s rank waits in (its heartbeat's records), or None."""
    for records in ((state or {}).get("groups") or {}).values():
        if records and records[-1].state in ("entered", "waiting"):
            return records[-1]
    return None


def _stale(state: dict[str, Any] | None, now: float, interval: float) -> bool:
    """No heartbeat for three beats: the rank stopped responding (dead, frozen or cut off)."""
    return now - (state or {}).get("t", 0) > 3 * interval


def _where(state: dict[str, Any] | None, now: float, interval: float) -> str:
    if state is None:
        return "has no heartbeat (not started, or the side channel is off)"
    frame = state.get("frame")
    where = f" at {os.path.basename(frame[0])}:{frame[1]}" if frame else ""
    if _stale(state, now, interval):
        return f"has sent no heartbeat for {now - state.get('t', 0):.0f}s (stopped or dead){where}"
    raw = state.get("raw")
    if raw:
        op, file, line, _, since = raw
        return (
            f"is in torch.distributed.{op} (from {os.path.basename(file)}:{line}) "
            f"for {now - since:.0f}s"
        )
    pending = _pending(state)
    if pending is not None:
        return f"is waiting in rankwise's {pending.op} #{pending.seq}"
    return f"is running user code{where}, in no collective"


P2P = frozenset({"send", "recv", "send_object_list", "recv_object_list"})
"""Point-to-point calls: a send and a recv that differ by name can still be a matching pair."""
DEADLOCK_KEY = "rankwise/diag/raw/deadlock"
"""Set in the store by the rank that found the ranks deadlocked: the others end too."""


class Stall(NamedTuple):
    """What ``check`` found: the report it printed (None on the ranks that do not print it)
    and whether the ranks are deadlocked (their calls can never complete: end the job)."""

    text: str | None
    deadlocked: bool
    missing: tuple[int, ...] = ()
    """The ranks in no collective (stuck elsewhere), when the job ends on the report."""
    facts: dict[str, Any] | None = None
    """For the missing ranks' launchers (``stall.stalled_sentence``): the call, who waited in
    it, where each missing rank was."""


def outside(states: dict[int, Any], world: int, now: float, interval: float) -> list[int]:
    """The ranks in no collective at all: neither a raw call nor one of rankwise's (whose
    own stall report covers it; under a pipeline with data parallel, the stages of the stuck
    rank's data group wait there, and were blamed with it), or silent for three heartbeats
    (a host cut off or dead: whatever its last heartbeat said, it is gone, and the cause)."""
    out = []
    for r in range(world):
        state = states.get(r) or {}
        if _stale(state, now, interval) or not (state.get("raw") or _pending(state) is not None):
            out.append(r)
    return out


def deadlocked(states: dict[int, Any], world: int, now: float, interval: float) -> bool:
    """Every rank is blocked in a raw ``torch.distributed`` call (fresh heartbeats, each call
    older than three heartbeats) and the calls differ, not as a send and a recv may: nobody
    can make progress, so none of these calls will ever return."""
    ops = set()
    for r in range(world):
        state = states.get(r) or {}
        found = state.get("raw")
        stale = now - state.get("t", 0) > 5 * interval  # a heartbeat late under load is no proof
        if not found or stale or now - found[4] < 3 * interval:
            return False
        ops.add(found[0])
    return len(ops) > 1 and not ops <= P2P


def report(
    me: int, world: int, states: dict[int, Any], now: float, interval: float, ending: bool = False,
    waits: bool = True,
) -> str:
    """The stall report over every rank's heartbeat (``states``: rank -> heartbeat or None).
    ``ending``: the ranks are deadlocked and the job ends now, not at the timeout."""
    parts = [f"rank {r} {_where(states.get(r), now, interval)}" for r in range(world)]
    ops = {tuple(s["raw"][:3]) for s in states.values() if s and s.get("raw")}
    elsewhere = outside(states, world, now, interval)
    gone = [r for r in elsewhere if _stale(states.get(r), now, interval)]
    idle = [r for r in elsewhere if r not in gone]
    if elsewhere:
        why = "; ".join(
            ([f"Rank(s) {', '.join(map(str, idle))} are not in any collective"] if idle else [])
            + ([f"Rank(s) {', '.join(map(str, gone))} stopped responding"] if gone else [])
        )
    elif len({o[0] for o in ops}) > 1:
        why = "The ranks are in different collectives (a mismatch: they can never match up)"
    else:
        why = "Every rank is in the same collective (a slow rank, or a mismatch of shapes)"
    if ending:
        after = ("(rankwise ends the job now: waiting for the timeout would change nothing; "
                 "--debug makes torch check each collective)")  # fmt: skip
    elif waits:
        after = ("(the job keeps waiting until the timeout, as RANKWISE_ON_STALL=wait asks; "
                 "--debug makes torch check each collective)")  # fmt: skip
    else:
        after = ("(rankwise ends the job now; RANKWISE_ON_STALL=wait waits for the timeout "
                 "instead; --debug makes torch check each collective)")  # fmt: skip
    return (
        f"rankwise: [rank {me}] stall in a torch.distributed collective: {'; '.join(parts)}. "
        f"{why}.\nFix: every rank must call the same torch.distributed collectives in the same "
        f"order; look for a collective inside `if rank == ...:` or a rank that stopped. {after}"
    )


def check(tracker: Tracker, mine: list | None, channel: Any, rank: int, world: int,
          interval: float, limit: float, waits: bool = True) -> Stall | None:  # fmt: skip
    """Print the report once per stuck call, from the lowest rank stuck in a raw collective,
    and look again at every heartbeat after it: once the ranks are deadlocked, that rank says
    so (``DEADLOCK_KEY``) and every rank ends."""
    if limit <= 0 or mine is None or world < 2:
        return None
    since, now = mine[4], time.time()
    if channel.get(DEADLOCK_KEY) is not None and now - since > 3 * interval:
        return Stall(None, True)  # the rank that reported it ends; so does this one
    if now - since < limit:
        return None
    first = tracker.reported != since
    tracker.reported = since
    states = {r: (channel.state(r) if r != rank else {"raw": mine, "t": now}) for r in range(world)}
    stuck = [r for r, s in states.items() if s and s.get("raw")]
    if stuck and rank != min(stuck):
        return None  # the lowest stuck rank reports, and says when to end (DEADLOCK_KEY)
    ending = deadlocked(states, world, now, interval)
    if not first and not ending:
        return None  # reported already, and not (yet) certain
    elsewhere = outside(states, world, now, interval)
    if not ending and not elsewhere:
        return None  # the others wait in rankwise's collectives: their stall report names who
    text = report(rank, world, states, now, interval, ending, waits)
    if not ending and not waits:  # the stall report ends the job (stall.py)
        print(text, file=sys.stderr, flush=True)
        channel.set(DEADLOCK_KEY, str(rank))
        where = {str(r): f"rank {r} {_where(states.get(r), now, interval)}"[:400]
                 for r in elsewhere[:64]}  # fmt: skip
        facts = {"op": f"torch.distributed.{mine[0]}", "waiting": stuck[:64], "where": where}
        return Stall(text, True, tuple(elsewhere), facts)
    print(text if first else f"rankwise: [rank {rank}] the stall reported above is a deadlock: "
          "every rank is blocked in a call that can never complete.", file=sys.stderr,
          flush=True)  # fmt: skip
    if ending:
        channel.set(DEADLOCK_KEY, str(rank))
    return Stall(text, ending)
