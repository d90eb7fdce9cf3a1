"""Recording a collective: its fingerprint, the rolling hash, the call site, the agreement check."""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

from ...errors import DistributedError
from ...timing import clock as timing
from ..channel import gather, sidechannel
from .entry import Entry, ended_by_a_stall_report, failure, kept
from .settings import Settings
from .state import STATE, Group
from .watch import SKIP, group_for

_MASK = (1 << 62) - 1  # fits an int64 tensor on every backend
_MULT = 0x100000001B3


def configure(**changes: Any) -> Settings:
    """Change the settings (see ``Settings``), e.g. ``configure(enabled=False)``; returns them.

    Call it on every rank with the same values (checks must line up across ranks).
    """
    STATE.settings = replace(STATE.settings, **changes)
    if "history" in changes:
        reset()
    # Toggling ``enabled`` keeps the sequence numbers: every rank toggles at the same point.
    return STATE.settings


def settings() -> Settings:
    return STATE.settings


def reset() -> None:
    """Forget all groups; stop and join the watchdog."""
    STATE.reset()


def _signature(op: str, tensors: Sequence[torch.Tensor], extra: str | None) -> tuple[str, int]:
    key = (op, extra, *[(t.dtype, tuple(t.shape)) for t in tensors])
    cache = STATE.signatures
    found = cache.get(key)
    if found is None:
        parts = [extra] if extra else []
        for t in tensors:
            dtype = str(t.dtype).removeprefix("torch.")
            parts.append(f"{dtype}[{','.join(str(s) for s in t.shape)}]")
        sig = ", ".join(parts)
        if len(cache) > 4096:  # shapes that change every step (variable lengths)
            cache.clear()
        found = cache[key] = (sig, zlib.crc32(f"{op}|{sig}".encode()))
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
    s = STATE.settings
    if not s.enabled:
        return _untracked(op, label)
    g = group_for(group)
    if g is None:
        return _untracked(op, label)
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    sig, digest = _signature(op, tensors, extra)
    g.seq += 1
    g.rolling = (g.rolling * _MULT + digest + 1) & _MASK
    site = sidechannel.user_site(sys._getframe(1), SKIP)
    now = time.time()
    e = Entry(g, g.seq, op, sig, digest, g.rolling, label, site, now)
    g.ring.append(e)
    g.channel.set(g.key_last, sidechannel.wire(g.seq, op, sig, label, site, digest, now))
    if s.checks and check is not False:
        due = check or g.seq <= s.check_first or (s.check_every and g.seq % s.check_every == 0)
        if due:
            _check(g, e)
    return e


def _check(g: Group, e: Entry) -> None:
    try:
        with timing.span("blocked", any_thread=True):  # it meets the peers: a wait for them
            gather.check(g, e, STATE.interval(), STATE.watchdog)
    except DistributedError as err:
        # The check's own all-gather failing while the job ends on a stall report: the
        # report's blame (as ``failure`` gives for the collective itself).
        ended = ended_by_a_stall_report(e, STATE.channel)
        if ended is None:
            kept(err)
            raise
        raise kept(ended) from err.__cause__


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
            raise failure(self.entry, exc) from None  # the message quotes the backend error
        return False


def verify(group: Any = None) -> None:
    """Check now that every rank issued the same collectives so far. Sync point: all ranks."""
    record("verify", group=group, check=True).done()


def recent(n: int = 16, group: Any = None) -> list[dict[str, Any]]:
    """This rank's last ``n`` recorded collectives of ``group``, oldest first."""
    pg = c10d._world.default_pg if group is None else group
    g = STATE.groups.get(id(pg)) if pg is not None else None
    return [] if g is None else [e.to_dict() for e in list(g.ring)[-n:]]


def last_report() -> str | None:
    """The latest diagnosis made on this rank (a failure, or the watchdog's stuck report)."""
    return STATE.last_report
