"""The watched world group: its side channel and the watchdog thread that publishes heartbeats
and reports collectives that outlive the timeout on backends that never raise (NCCL)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ... import runtime
from ...output.console import printable
from .. import raw, report, stall
from ..channel import gather, sidechannel
from .entry import completed, failure
from .state import STATE, Group

SKIP = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    + os.sep,  # rankwise
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,  # torch (autograd, c10d)
    os.path.abspath(threading.__file__),
    "<frozen",
)
"""Frames skipped when looking for the user's call site."""


def group_for(group: Any) -> Group | None:
    """The record of ``group`` (None: the default group), made on first use; None when there
    is nothing to record (no group, not a member, a group of one)."""
    pg = c10d._world.default_pg if group is None else group
    if pg is None or pg is c10d.GroupMember.NON_GROUP_MEMBER:
        return None
    g = STATE.groups.get(id(pg))
    if g is not None and g.pg is pg:
        return g
    world = c10d._world.default_pg
    if world is not STATE.world:
        _start_world(world)
    if pg.size() < 2:
        return None
    name = "world" if pg is world else str(getattr(pg, "group_name", "") or f"pg{id(pg)}")
    g = STATE.groups[id(pg)] = Group(pg, name, STATE.channel, STATE.settings.history)
    return g


def watch_world() -> None:
    """Start the world group's watchdog now (``rw.init``), not at rankwise's first collective,
    so a script that only calls ``torch.distributed`` directly is watched too (``raw``)."""
    if STATE.settings.enabled and dist.is_available() and dist.is_initialized():
        group_for(None)


def _start_world(world: Any) -> None:
    STATE.reset()
    if not STATE.hooks_registered:
        atexit.register(STATE.reset)
        runtime.on_shutdown(STATE.reset)  # the watchdog talks to the store the group drops
        atexit.register(_announce_if_raised)  # runs first (atexit is last in, first out)
        STATE.hooks_registered = True
    try:
        store = c10d._get_default_store()
    except Exception:
        store = None
    channel = sidechannel.Channel(store)
    wd = sidechannel.Watchdog(
        channel,
        dist.get_rank(),
        STATE.interval(),
        snapshot=_snapshot,
        overdue=_overdue,
        skip=SKIP,
        keep_going=lambda: c10d._world.default_pg is world,
        node=runtime.coords().node,
    )
    STATE.world, STATE.channel, STATE.watchdog = world, channel, wd
    wd.beat(channel)
    wd.start()


@contextlib.contextmanager
def blocked(what: str) -> Iterator[None]:
    """While inside, this rank's heartbeat says it waits on ``what`` (a pipeline receive: a
    transfer that is no recorded collective), since now."""
    before, STATE.blocked = STATE.blocked, [what[:200], time.time()]
    try:
        yield
    finally:
        STATE.blocked = before


def _snapshot() -> dict[str, Any] | None:
    """Entry states for the heartbeat (None: disabled, skip it); notices completed async works."""
    if not STATE.settings.enabled:
        return None
    groups = {}
    for g in list(STATE.groups.values()):
        tail = list(g.ring)[-8:]
        for e in tail:
            work = e.work
            if work is not None and e.state == "waiting" and completed(work):
                e.finish()
        groups[g.name] = [e.to_dict() for e in tail]
    return {"groups": groups, "blocked": STATE.blocked}


def _overdue() -> None:
    """Report collectives pending for all but two heartbeats of the timeout (backends that
    never raise, such as NCCL, which aborts the process at the timeout)."""
    wd = STATE.watchdog
    if wd is not None:  # another rank reported a stall and ended the job: so does this one
        stall.follow(wd, wd.rank)
    stall.check(list(STATE.groups.values()), STATE.watchdog, STATE.interval(), STATE.timeout_s())
    if wd is not None and STATE.world is not None:
        world = STATE.world.size()
        found = raw.check(wd.raw, wd.raw_now, wd.own, wd.rank, world, STATE.interval(),
                          stall.after_s(), stall.waits())  # fmt: skip
        if found is not None and found.deadlocked:
            if found.missing:  # ranks in user code: they end through the stall's key
                note = json.dumps({"rank": wd.rank, "missing": list(found.missing),
                                   "node": wd.node, "msg": (found.text or "")[:1000],
                                   **(found.facts or {})})  # fmt: skip
                wd.own.set_bounded(stall.END_KEY, note, 2.0)
                stall.await_readers(wd, STATE.interval())
            _end_deadlocked(wd.rank, found.text, found.missing)
    limit = STATE.timeout_s() - 2 * STATE.interval()
    now = time.time()
    for g in list(STATE.groups.values()):
        if g.gloo:  # gloo raises at the timeout; the exception carries the diagnosis
            continue
        for e in list(g.ring)[-8:]:
            if e.state in ("entered", "waiting") and not e.reported and now - e.t0 > limit:
                e.reported = True
                note = f"the timeout of {STATE.timeout_s():.0f}s is near"
                gather.log_overdue(failure(e, TimeoutError(note), mark=False))


_ENDED: dict[str, bool] = {"raised": False}
"""Set once this process announced an exception: a later ``rw.shutdown`` must not say
"finished normally" over it (``spawn`` shuts down after reporting the error)."""


def _end_deadlocked(rank: int, text: str | None, missing: tuple[int, ...] = ()) -> None:
    """Every rank is blocked in a raw torch.distributed call that can never return (``raw``):
    leave the report for the launcher and end this rank now, not at the timeout. The main
    thread is inside the backend's C++ wait, where no Python exception can reach it: the
    process ends from here, its output flushed."""
    if text is not None:
        body, _, fix = text.partition("\nFix: ")
        body = body.removeprefix(f"rankwise: [rank {rank}] ")
        cause = None if missing else report.Cause("mismatch", "", fix, [])
        gather.write_diag_file(rank, body, fix, list(missing), cause=cause)
    why = (
        "the ranks are blocked in torch.distributed calls that can never complete"
        if not missing
        else f"rank(s) {', '.join(map(str, missing))} never arrived (RANKWISE_ON_STALL=wait waits)"
    )
    print(f"rankwise: [rank {rank}] ending this rank (exit code 1): {why} (see the stall report).",
          file=sys.stderr, flush=True)  # fmt: skip
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(1)


def announce_finished() -> None:
    """This rank ends (``runtime.shutdown``, also at a clean exit): say so in the store.

    A rank still waiting in a collective this one never issued then reads "rank 1 had already
    finished normally" instead of "never reported" (gather.collect_views). But a shutdown
    reached while an exception propagates (``try: ... finally: rw.shutdown()``) is no normal
    end: that announces the exception instead. One store write; never raises (the store may be
    gone already).
    """
    if _ENDED["raised"]:
        return
    active = sys.exc_info()[1]
    if active is not None and not _clean_exit(active):
        announce_raised(active)
        return
    try:
        channel = STATE.channel or sidechannel.Channel(c10d._get_default_store())
        site = sidechannel.user_site(sys._getframe(1), SKIP)
        done = {
            "t": time.time(),
            "site": [site.file, site.line, site.func] if site else None,
            "issued": {g.name: g.seq for g in STATE.groups.values()},
        }
        # Bounded: on a node cut off from the store's host a write can block (a full buffer).
        channel.set_bounded(sidechannel.key_finished(dist.get_rank()), json.dumps(done), 2.0)
    except Exception:  # diagnosis never breaks a clean exit
        pass


def _announce_if_raised() -> None:
    """At exit after an uncaught exception (Python, and ``rankwise run``'s bootstrap, leave it
    in ``sys.last_value``), on any backend: tell the others which exception ended this rank."""
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if failed is not None:
        announce_raised(failed)


def _clean_exit(exc: BaseException) -> bool:
    return isinstance(exc, SystemExit) and exc.code in (None, 0)


def announce_raised(exc: BaseException) -> None:
    """This rank ends on ``exc``: publish its type and message (escaped, at most 500
    characters) and the user's line it came from, so that the ranks left waiting say
    "rank 0 raised ValueError: ..." instead of blaming each other. Never raises."""
    if _clean_exit(exc) or _ENDED["raised"]:
        return
    _ENDED["raised"] = True
    if getattr(exc, "waited_for", None):  # a failed collective others caused: not a cause
        return
    try:
        if not dist.is_initialized():
            return
        channel = STATE.channel or sidechannel.Channel(c10d._get_default_store())
        site = _raising_site(exc)
        note = {
            "t": time.time(),
            "error": printable(_exception_text(exc), 500),
            "site": [site.file, site.line, site.func] if site else None,
        }
        channel.set(sidechannel.key_raised(dist.get_rank()), json.dumps(note))
    except Exception:  # diagnosis never makes a failure worse
        pass


def _exception_text(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: sys.exit({exc.code!r})"
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


def _raising_site(exc: BaseException) -> sidechannel.Site | None:
    """The last user line of the exception's traceback (where it came from, in user code)."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not sidechannel.internal(code.co_filename, SKIP):
            found = sidechannel.Site(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return found


# Registered at import (comm imports the fingerprints): a rank that issued no collective, whose
# side channel never started, still announces its end. Runs before STATE.reset (registered later).
runtime.on_shutdown(announce_finished)
