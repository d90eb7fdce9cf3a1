"""Sends in flight between pipeline stages over Gloo, each tensor freed the moment its send
completes.

A Gloo send completes only once the receiver has posted the matching receive, and it reports
complete only after it is waited on (``Work.is_completed`` stays False until then): polling
would never free anything, and waiting on a send from the computing thread would stall this
stage until the peer asks for the message. So one waiter thread per destination waits on that
destination's sends in the order they were posted (``Work.wait`` releases the GIL) and drops
each tensor as soon as its send is done. A stage then holds, for its peers, only what they have
not asked for yet: the schedule's in-flight messages (1F1B's bound), not every tensor of the
step.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Held:
    """What a stage holds for its peers: sends posted and not yet complete (``peak_*``: the
    most at once since the last ``reset_peak``)."""

    sends: int
    bytes: int
    peak_sends: int
    peak_bytes: int


class SendQueue:
    """Posted sends, waited on by one thread per destination (daemon threads, started on the
    first send to a destination; idle between steps, ended by ``close``)."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._cond = threading.Condition()
        self._sends = self._bytes = self._peak_sends = self._peak_bytes = 0
        self._failure: tuple[str, str] | None = None

    def add(self, work: dist.Work, tensor: torch.Tensor, dst: int, what: str) -> None:
        """Hold ``tensor`` until ``work`` (its send to ``dst``) completes."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._cond:
            self._sends += 1
            self._bytes += nbytes
            self._peak_sends = max(self._peak_sends, self._sends)
            self._peak_bytes = max(self._peak_bytes, self._bytes)
        q = self._queues.get(dst)
        if q is None:
            q = self._queues[dst] = queue.SimpleQueue()
            threading.Thread(target=self._waiter, args=(q,), daemon=True,
                             name=f"rankwise-pipe-sends-to-{dst}").start()  # fmt: skip
        q.put((work, tensor, nbytes, what))

    def _waiter(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:  # closed
                return
            work, tensor, nbytes, what = item
            del item
            cause = ""
            try:
                if work.wait(timeout=self.timeout) is False:
                    cause = "timed out"
            except RuntimeError as exc:
                cause = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            del work, tensor  # the tensor is freed here, not at the end of the step
            with self._cond:
                if cause and self._failure is None:
                    self._failure = (what, cause)
                self._sends -= 1
                self._bytes -= nbytes
                self._cond.notify_all()

    def failure(self) -> tuple[str, str] | None:
        """(what, why) of the first send that failed, if one did."""
        with self._cond:
            return self._failure

    def drain(self) -> tuple[str, str] | None:
        """Wait until every send is complete; (what, why) of a failure or of the wait timing
        out, None if all went out."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._sends == 0, self.timeout.total_seconds())
            if self._failure is not None:
                return self._failure
            return None if done else (f"{self._sends} sends", "timed out")

    def close(self) -> None:
        """End the waiter threads once they have waited on what they hold."""
        for q in self._queues.values():
            q.put(None)
        self._queues = {}

    def held(self) -> Held:
        with self._cond:
            return Held(self._sends, self._bytes, self._peak_sends, self._peak_bytes)

    def reset_peak(self) -> None:
        with self._cond:
            self._peak_sends, self._peak_bytes = self._sends, self._bytes
