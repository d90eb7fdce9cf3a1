"""Collective fingerprints: what each rank issued, checked across ranks, explained on failure.

Hot path of ``record`` (every collective rankwise issues): a signature lookup (cached per
op/shape/dtype), a rolling hash, the user's call site (a walk up ``f_back`` to the first frame
outside rankwise and torch), a ring-buffer append and one TCPStore ``set`` (no reply awaited).
A few microseconds (``benchmarks/diagnostics.py``). Agreement checks all-gather ``(seq, rolling hash)`` before the collective exchanges data. The
rolling hash covers every collective so far, so a check also vouches for all unchecked ones
before it. Checked: each of the first ``check_first`` collectives, then every ``check_every``-th,
and every call that passes ``check=True`` (the user-level helpers in ``rankwise.comm``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import env as envmod
from .. import runtime
from ..errors import ConfigError, DistributedError
from . import gather, sidechannel, stall
from .report import Record

_SKIP = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # rankwise itself
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,  # torch (autograd, c10d)
    os.path.abspath(threading.__file__),
    "<frozen",
)
_MASK = (1 << 62) - 1  # fits an int64 tensor on every backend
_MULT = 0x100000001B3


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How collectives are recorded and checked (``configure`` changes them)."""

    enabled: bool = True
    """Record and publish collectives; off means no recording, no checks, no watchdog."""
    checks: bool = True
    """All-gather fingerprints before checked collectives (first N, every N-th, check=True)."""
    check_first: int = 32
    """Check each of the first N collectives of a group (start-up: broadcasts, first steps)."""
    check_every: int = 256
    """Afterwards check every N-th collective (0: never); one check covers all earlier ones."""
    history: int = 256
    """Entries kept per group (the ring buffer)."""
    heartbeat_s: float = 1.0
    """Watchdog period in seconds (capped at a tenth of the timeout)."""

    def __post_init__(self) -> None:
        for name in ("check_first", "check_every", "history"):
            if getattr(self, name) < (1 if name == "history" else 0):
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is out of range",
                    fix=f"pass {name} >= {1 if name == 'history' else 0}.",
                )
        if self.heartbeat_s <= 0:
            raise ConfigError(
                f"heartbeat_s={self.heartbeat_s!r} must be positive", fix="e.g. heartbeat_s=1.0."
            )


_settings = Settings(enabled=envmod.fingerprints_enabled())


class Entry:
    """One recorded collective. ``done()``/``watch(work)``/``wait()`` track its completion."""

    __slots__ = (
        "digest", "error", "group", "label", "op", "reported", "rolling", "seq", "sig", "site",
        "state", "t0", "t1", "work",
    )  # fmt: skip

    def __init__(self, group, seq, op, sig, digest, rolling, label, site, t0) -> None:
        self.group, self.seq, self.op, self.sig = group, seq, op, sig
        self.digest, self.rolling, self.label, self.site = digest, rolling, label, site
        self.t0, self.t1, self.state = t0, None, "entered"
        self.error, self.work, self.reported = None, None, False

    def done(self) -> None:
        """The call returned. On a GPU group (NCCL) the kernel may still be queued, so an event
        on the current stream stands for it until the watchdog sees it complete."""
        g = self.group
        if g is not None and g.device is not None and self.work is None:
            event = torch.cuda.Event()
            event.record()
            self.work, self.state = event, "waiting"
            return
        self.finish()

    def finish(self) -> None:
        """Mark the collective complete."""
        self.state, self.t1, self.work = "done", time.time(), None

    def watch(self, work: Any) -> Any:
        """Attach the ``Work`` of an ``async_op=True`` call; the watchdog polls it. Returns it."""
        self.work, self.state = work, "waiting"
        return work

    def wait(self, timeout: float | timedelta | None = None) -> None:
        """Wait for the watched work; a failure or timeout raises the diagnosis.

        Sync point: the ranks of the collective's group.
        """
        work = self.work
        if work is None:
            return
        try:
            if timeout is None:
                finished = work.wait()
            else:
                td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
                finished = work.wait(td)
        except Exception as exc:
            raise failure(self, exc) from exc
        if finished is False:
            raise failure(self, TimeoutError(f"timed out after {timeout}s"))
        if _completed(work):  # gloo: always; NCCL: wait() only ordered the current stream
            self.finish()

    def record(self, state: str | None = None) -> Record:
        return Record(
            self.seq, self.op, self.sig, self.label, self.site, state or self.state, self.digest
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "op": self.op, "sig": self.sig, "label": self.label,
            "site": list(self.site) if self.site else None, "state": self.state,
            "digest": self.digest, "t0": self.t0, "t1": self.t1, "error": self.error,
        }  # fmt: skip


class _Group:
    """Sequence numbers, rolling hash and history of one process group."""

    def __init__(self, pg: Any, name: str, channel: sidechannel.Channel) -> None:
        self.pg, self.name, self.channel = pg, name, channel
        self.size, self.rank = pg.size(), pg.rank()
        self.ranks = dist.get_process_group_ranks(pg)
        self.global_rank = self.ranks[self.rank]
        self.key_last = sidechannel.key_last(name, self.global_rank)
        self.seq, self.rolling = 0, 0
        self.ring: deque[Entry] = deque(maxlen=_settings.history)
        backend = str(dist.get_backend(pg))
        self.gloo = "gloo" in backend
        cuda = "nccl" in backend and not self.gloo
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None


_groups: dict[int, _Group] = {}
_world: dict[str, Any] = {"pg": None, "channel": None, "watchdog": None}
_signatures: dict[tuple, tuple[str, int]] = {}


def configure(**changes: Any) -> Settings:
    """Change the settings (see ``Settings``), e.g. ``configure(enabled=False)``; returns them.

    Call it on every rank with the same values (checks must line up across ranks).
    """
    global _settings
    _settings = replace(_settings, **changes)
    if "history" in changes:
        reset()
    # Toggling ``enabled`` keeps the sequence numbers: every rank toggles at the same point.
    return _settings


def settings() -> Settings:
    return _settings


def reset() -> None:
    """Forget all groups; stop AND join the watchdog (also at exit: a daemon thread killed
    inside a store call at finalisation aborts the process with SIGABRT)."""
    wd = _world["watchdog"]
    if wd is not None:
        wd.stopped.set()
        if wd.is_alive() and wd is not threading.current_thread():
            wd.join(timeout=10)
    _groups.clear()
    _world.update(pg=None, channel=None, watchdog=None)


def _timeout_s() -> float:
    if runtime.is_initialized():
        return runtime.get_runtime().timeout.total_seconds()
    return c10d.default_pg_timeout.total_seconds()


def _interval() -> float:
    return max(0.05, min(_settings.heartbeat_s, _timeout_s() / 10))


def _start_world(world: Any) -> None:
    reset()
    if not _world.get("atexit"):
        atexit.register(reset)
        _world["atexit"] = True
    try:
        store = c10d._get_default_store()
    except Exception:
        store = None
    channel = sidechannel.Channel(store)
    wd = sidechannel.Watchdog(
        channel,
        dist.get_rank(),
        _interval(),
        snapshot=_snapshot,
        overdue=_overdue,
        skip=_SKIP,
        keep_going=lambda: c10d._world.default_pg is world,
    )
    _world.update(pg=world, channel=channel, watchdog=wd)
    wd.beat(channel)
    wd.start()


def _group_for(group: Any) -> _Group | None:
    pg = c10d._world.default_pg if group is None else group
    if pg is None or pg is c10d.GroupMember.NON_GROUP_MEMBER:
        return None
    g = _groups.get(id(pg))
    if g is not None and g.pg is pg:
        return g
    world = c10d._world.default_pg
    if world is not _world["pg"]:
        _start_world(world)
    if pg.size() < 2:
        return None
    name = "world" if pg is world else str(getattr(pg, "group_name", "") or f"pg{id(pg)}")
    g = _groups[id(pg)] = _Group(pg, name, _world["channel"])
    return g


def _signature(op: str, tensors: Sequence[torch.Tensor], extra: str | None) -> tuple[str, int]:
    key = (op, extra, *[(t.dtype, tuple(t.shape)) for t in tensors])
    found = _signatures.get(key)
    if found is None:
        parts = [extra] if extra else []
        for t in tensors:
            dtype = str(t.dtype).removeprefix("torch.")
            parts.append(f"{dtype}[{','.join(str(s) for s in t.shape)}]")
        sig = ", ".join(parts)
        if len(_signatures) > 4096:  # shapes that change every step (variable lengths)
            _signatures.clear()
        found = _signatures[key] = (sig, zlib.crc32(f"{op}|{sig}".encode()))
    return found


def _untracked(op: str, label: str | None) -> Entry:
    return Entry(None, 0, op, "", 0, 0, label, None, time.time())


def record(
    op: str,
    tensors: torch.Tensor | Sequence[torch.Tensor] = (),
    *,
    label: str | None = None,
    group: Any = None,
    extra: str | None = None,
    check: bool | None = None,
) -> Entry:
    """Record a collective about to be issued; check it across ranks when one is due.

    ``op`` names the operation ('all_reduce'), ``tensors`` are its inputs (shapes and dtypes go
    into the fingerprint), ``label`` says what it is for ('bucket 3'), ``extra`` adds details
    that must agree across ranks ('sum', 'src=0'). ``check``: True always checks, False never,
    None follows the settings. Sync point (only when a check runs): the ranks of ``group``.
    """
    if not _settings.enabled:
        return _untracked(op, label)
    g = _group_for(group)
    if g is None:
        return _untracked(op, label)
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    sig, digest = _signature(op, tensors, extra)
    g.seq += 1
    g.rolling = (g.rolling * _MULT + digest + 1) & _MASK
    site = sidechannel.user_site(sys._getframe(1), _SKIP)
    now = time.time()
    e = Entry(g, g.seq, op, sig, digest, g.rolling, label, site, now)
    g.ring.append(e)
    g.channel.set(g.key_last, sidechannel.wire(g.seq, op, sig, label, site, digest, now))
    s = _settings
    if s.checks and check is not False:
        due = check or g.seq <= s.check_first or (s.check_every and g.seq % s.check_every == 0)
        if due:
            _check(g, e)
    return e


class collective:
    """``with collective("all_reduce", t, label="loss"): dist.all_reduce(t)``.

    Records on entry, marks done on exit, and turns a backend error or timeout inside the block
    into a ``DistributedError`` that names every rank's last collective and call site.
    """

    __slots__ = ("args", "entry", "kwargs")

    def __init__(self, op: str, tensors: Any = (), **kwargs: Any) -> None:
        self.args, self.kwargs, self.entry = (op, tensors), kwargs, None

    def __enter__(self) -> Entry:
        self.entry = record(*self.args, **self.kwargs)
        return self.entry

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            self.entry.done()
        elif isinstance(exc, (RuntimeError, TimeoutError)) and not isinstance(
            exc, DistributedError
        ):
            raise failure(self.entry, exc) from exc
        return False


def verify(group: Any = None) -> None:
    """Check now that every rank issued the same collectives so far. Sync point: all ranks."""
    record("verify", group=group, check=True).done()


def recent(n: int = 16, group: Any = None) -> list[dict[str, Any]]:
    """This rank's last ``n`` recorded collectives of ``group``, oldest first."""
    pg = c10d._world.default_pg if group is None else group
    g = _groups.get(id(pg)) if pg is not None else None
    return [] if g is None else [e.to_dict() for e in list(g.ring)[-n:]]


def last_report() -> str | None:
    """The latest diagnosis made on this rank (a failure, or the watchdog's stuck report)."""
    return gather.last["report"]


def failure(entry: Entry, exc: BaseException) -> DistributedError:
    """The diagnosis of ``entry`` failing with ``exc`` (gathered over the side channel).

    Raise it: ``raise failure(entry, exc) from exc``. Waits at most a few heartbeats.
    """
    if isinstance(exc, DistributedError):
        return exc
    return gather.failure_error(entry, exc, _interval(), _world["watchdog"], _world["channel"])


def _check(g: _Group, e: Entry) -> None:
    gather.check(g, e, _interval(), _world["watchdog"])


def _completed(work: Any) -> bool:
    return work.query() if isinstance(work, torch.cuda.Event) else work.is_completed()


def _snapshot() -> dict[str, Any] | None:
    """Entry states for the heartbeat (None: disabled, skip it); notices completed async works."""
    if not _settings.enabled:
        return None
    groups = {}
    for g in list(_groups.values()):
        tail = list(g.ring)[-8:]
        for e in tail:
            work = e.work
            if work is not None and e.state == "waiting" and _completed(work):
                e.finish()
        groups[g.name] = [e.to_dict() for e in tail]
    return {"groups": groups}


def _overdue() -> None:
    """Report collectives pending for all but two heartbeats of the timeout (backends that
    never raise, such as NCCL, which aborts the process at the timeout)."""
    stall.check(list(_groups.values()), _world["watchdog"], _interval(), _timeout_s())
    limit = _timeout_s() - 2 * _interval()
    now = time.time()
    for g in list(_groups.values()):
        if g.gloo:  # gloo raises at the timeout; the exception carries the diagnosis
            continue
        for e in list(g.ring)[-8:]:
            if e.state in ("entered", "waiting") and not e.reported and now - e.t0 > limit:
                e.reported = True
                wd = _world["watchdog"]
                note = f"the timeout of {_timeout_s():.0f}s is near"
                err = gather.failure_error(
                    e, TimeoutError(note), _interval(), wd, wd.own, mark=False
                )
                gather.log_overdue(err)
