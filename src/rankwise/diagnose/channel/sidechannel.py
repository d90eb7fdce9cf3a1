"""The side channel: every rank's last collectives and heartbeat, kept in the rendezvous store.

The store (torch's TCPStore behind ``init_process_group``, hosted by the launcher's agent or by
rank 0) stays reachable when a collective is stuck, so it can say what every rank was doing.
Keys (under the store's own prefix):

- ``rankwise/diag/{group}/last/{rank}``: the collective a rank is about to issue. Written before
  every collective, from the issuing thread (a TCPStore ``set`` is one socket write, ~2 us:
  no reply is awaited), so it survives a rank that is killed or aborts inside the collective.
- ``rankwise/diag/state/{rank}``: JSON heartbeat from the watchdog thread: time, where the main
  thread is, the states (waiting/done/failed) of the last entries of every group.
- ``rankwise/diag/{group}/ring/{rank}``: a rank's whole history, written only on a mismatch.
- ``rankwise/diag/finished/{rank}``: JSON written once when a rank ends normally (``rw.shutdown``
  or a clean exit): time, where, how many collectives it issued. A rank waiting in a collective
  that a finished rank will never issue can then say so instead of "never reported".
- ``rankwise/diag/raised/{rank}``: JSON written instead when a rank ends on an exception: the
  exception's type and message (escaped, at most 500 characters) and the user's line it came
  from, so the others say "rank 0 raised ValueError: ..." rather than blame themselves.

Everything read back from other ranks goes through ``peer`` (untrusted data).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import raw, report
from ..frames import internal
from ..records import Site
from . import peer, reach
from .peer import SEP

_log = logging.getLogger("rankwise.diagnose")
_PREFIX = "rankwise/diag"


def key_last(group: str, rank: int) -> str:
    return f"{_PREFIX}/{group}/last/{rank}"


def key_state(rank: int) -> str:
    return f"{_PREFIX}/state/{rank}"


def key_ring(group: str, rank: int) -> str:
    return f"{_PREFIX}/{group}/ring/{rank}"


def key_finished(rank: int) -> str:
    return f"{_PREFIX}/finished/{rank}"


def key_raised(rank: int) -> str:
    return f"{_PREFIX}/raised/{rank}"


def wire(
    seq: int, op: str, sig: str, label: str | None, site: Site | None, digest: int, t: float
) -> str:
    """The compact line published before each collective (parsed by ``parse_wire``)."""
    f, line, func = (site.file, site.line, site.func) if site else ("", 0, "")
    return SEP.join((str(seq), op, sig, label or "", f, str(line), func, str(digest), f"{t:.3f}"))


class Channel:
    """Reads and writes the diagnosis keys; turns itself off (once, with a warning) on errors."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.ok = store is not None
        # Reads give up after reach.READ_TIMEOUT_S: a node cut off from the store's host.
        self.reads = reach.BoundedReads(store)
        self.missed: str | None = None
        """The store's 'host:port' when the latest read got no answer (cleared by one that did)."""
        self.gone: str | None = None
        """The store's 'host:port' once it closed or refused the connection (its host died)."""

    def _off(self, exc: BaseException) -> None:
        if self.ok:
            _log.warning("rankwise diagnosis side channel disabled: %s", exc)
        self.ok = False
        if reach.closed(exc):
            self.gone = self.reads.where

    def set(self, key: str, value: str) -> None:
        # A read to this store is stuck (no answer: cut off), and holds the client's lock.
        if not self.ok or self.reads.unreachable:
            return
        try:
            self.store.set(key, value)
        except Exception as exc:  # the store host is gone: diagnose with local facts only
            self._off(exc)

    def set_bounded(self, key: str, value: str, timeout: float) -> None:
        """``set`` that gives up after ``timeout`` s (at exit: a store cut off by the network
        must not hold the process)."""
        if not self.ok or self.reads.unreachable:
            return
        try:
            self.reads.call(self.store.set, key, value, timeout=timeout)
        except reach.Unreachable:
            self.missed = self.reads.where
        except Exception as exc:
            self._off(exc)

    def add_bounded(self, key: str, amount: int, timeout: float) -> int | None:
        """The store's counter ``key`` after adding ``amount`` (0 reads it), or None when the
        store did not answer within ``timeout`` s or is gone."""
        if not self.ok or self.reads.unreachable:
            return None
        try:
            return int(self.reads.call(self.store.add, key, amount, timeout=timeout))
        except reach.Unreachable:
            self.missed = self.reads.where
        except Exception as exc:
            self._off(exc)
        return None

    def get(self, key: str) -> str | None:
        """The value of ``key``, or None when it is not set (never blocks on a missing key)."""
        if not self.ok:
            return None
        try:
            value = self.reads.call(self._read, key)
        except reach.Unreachable:
            self.missed = self.reads.where
            return None
        except Exception as exc:
            self._off(exc)
            return None
        self.missed = None
        return value

    def _read(self, key: str) -> str | None:
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode("utf-8", "replace")

    def finished(self, rank: int) -> dict[str, Any] | None:
        """What ``rank`` published when it ended normally; None while it has not."""
        return peer.exit_note(peer.loads(self.get(key_finished(rank))))

    def raised(self, rank: int) -> dict[str, Any] | None:
        """What ``rank`` published when it ended on an exception (``error``: 'ValueError: ...',
        escaped; ``site``: the user's line it came from); None when it has not."""
        note = peer.exit_note(peer.loads(self.get(key_raised(rank))))
        return note if note is not None and "error" in note else None

    def state(self, rank: int) -> dict[str, Any] | None:
        """``rank``'s latest heartbeat, checked field by field (``peer.heartbeat``)."""
        return peer.heartbeat(peer.loads(self.get(key_state(rank))))


def user_site(frame: Any, skip: tuple[str, ...]) -> Site | None:
    """The first frame, walking outwards, that is the user's (``internal`` is False).

    Its file joins the files this rank has seen in its own stack, the only ones a report may
    quote (``report.if_context``): a peer's call site is never opened."""
    while frame is not None:
        code = frame.f_code
        if not internal(code.co_filename, skip):
            report.LOCAL_FILES.add(code.co_filename)
            return Site(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


class Watchdog(threading.Thread):
    """A daemon thread: heartbeat + entry states to the store, completion of async works.

    It also reports a collective still pending after ``report_after`` seconds, for backends
    whose collectives never raise on their own (NCCL aborts the process on its timeout, so the
    diagnosis has to be out before that); gloo raises at the timeout and reports through the
    exception instead.
    """

    def __init__(
        self,
        channel: Channel,
        rank: int,
        interval: float,
        snapshot: Callable[[], dict[str, Any] | None],
        overdue: Callable[[], None],
        skip: tuple[str, ...],
        keep_going: Callable[[], bool],
        node: int | None = None,
    ) -> None:
        super().__init__(name="rankwise-diagnose", daemon=True)
        self.node = node  # this rank's node (machine) index, so peers can name a lost node
        self.channel, self.rank, self.interval = channel, rank, interval
        self.own = channel
        self.snapshot, self.overdue, self.skip = snapshot, overdue, skip
        self.keep_going = keep_going
        self.main_ident = threading.main_thread().ident
        self.stopped = threading.Event()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.raw = raw.Tracker()  # the main thread inside a torch.distributed call (diagnose.raw)
        self.raw_now: list | None = None

    def main_frame(self) -> Site | None:
        frame = sys._current_frames().get(self.main_ident)
        return user_site(frame, self.skip)

    def beat(self, channel: Channel | None = None) -> None:
        """Publish this rank's heartbeat once (the main thread passes its own ``channel``)."""
        snapshot = self.snapshot()
        if snapshot is None:
            return
        frame = self.main_frame()
        self.raw_now = self.raw.sample(self.main_ident)
        payload = {
            "t": time.time(),
            "host": self.host,
            "pid": self.pid,
            "node": self.node,
            "frame": [frame.file, frame.line, frame.func] if frame else None,
            "raw": self.raw_now,
            **snapshot,
        }
        (channel or self.own).set(key_state(self.rank), json.dumps(payload))

    def run(self) -> None:
        try:
            # Its own connection: the heartbeat never queues behind the main thread's store use.
            self.own = Channel(self.channel.store.clone())
        except Exception:
            self.own = self.channel
        while not self.stopped.wait(self.interval) and self.keep_going():
            try:
                self.beat()
                self.overdue()
            except Exception as exc:  # never let diagnosis kill training
                _log.debug("rankwise watchdog tick failed: %s", exc)
