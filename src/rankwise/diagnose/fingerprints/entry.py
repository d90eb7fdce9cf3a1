"""One recorded collective (``Entry``), its completion, and the diagnosis when it fails."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch

from ...errors import DistributedError
from .. import stall
from ..channel import gather
from ..report import Record
from .state import STATE


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
            raise failure(self, exc) from None  # the message quotes the backend error
        if finished is False:
            raise failure(self, TimeoutError(f"timed out after {timeout}s"))
        if completed(work):  # gloo: always; NCCL: wait() only ordered the current stream
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


def completed(work: Any) -> bool:
    """True when an async ``Work`` (or the CUDA event standing for an NCCL kernel) finished."""
    return work.query() if isinstance(work, torch.cuda.Event) else work.is_completed()


def kept(err: DistributedError) -> DistributedError:
    """Remember ``err`` as this rank's latest diagnosis (``last_report``); returns it."""
    STATE.last_report = str(err)
    return err


def failure(entry: Entry, exc: BaseException, *, mark: bool = True) -> DistributedError:
    """The diagnosis of ``entry`` failing with ``exc`` (gathered over the side channel).

    Raise it: ``raise failure(entry, exc) from None`` (its message quotes the backend error,
    which stays in ``__context__``). Waits at most a few heartbeats.
    ``mark=False``: the collective has not failed yet, it is overdue (the watchdog's report).
    """
    if isinstance(exc, DistributedError):
        return exc
    channel = STATE.channel if mark else STATE.watchdog.own
    ended = ended_by_a_stall_report(entry, channel) if mark else None
    if ended is not None:
        return kept(ended)
    return kept(
        gather.failure_error(entry, exc, STATE.interval(), STATE.watchdog, channel, mark=mark)
    )


def ended_by_a_stall_report(entry: Entry, channel: Any) -> DistributedError | None:
    """The error of a collective that failed because another rank reported a stall and is
    ending the job (its peers on other nodes left on the note): the report's blame, as the
    ranks that read the note leave it, not "nodes 1 and 2 stopped responding"."""
    g = entry.group
    if g is None or channel is None or stall.waits():
        return None
    adopted = stall.adopt_end_note(channel, g.global_rank, getattr(STATE.watchdog, "node", None))
    if adopted is None:
        return None
    note, missing = adopted
    err = DistributedError(note["said"], fix=note["fix"], rank=g.global_rank)
    err.waited_for = sorted(set(missing) - {g.global_rank})
    return err
