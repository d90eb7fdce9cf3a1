"""Sends in flight between pipeline stages over Gloo, each tensor freed once the schedule says
its receiver has read it.

A Gloo send completes only once the receiver has posted the matching receive, and it reports
complete only after it is waited on (``Work.is_completed`` stays False until then): polling
would never free anything, and waiting on a send right after posting it would stall this stage
until the peer asks for the message. The schedule says when the peer has read it: a message
the peer sends after reading ours (its "acknowledgement", ``Schedule.acks``) arrives only then.
So on reading a peer's message the executor calls ``release`` with how many of this stage's
messages that peer had read, and the sends of those are waited on (they are complete: the wait
returns at once) and dropped. A stage then holds, for its peers, only what they have not read
yet (1F1B's in-flight bound), not every tensor of the step.

No thread waits on sends: a waiter thread that wakes for every completed send competes for the
GIL with the computing thread; on two cores it stalled about one receive in ten by 1.5-5 ms
(a probe of the simulated 1F1B schedule, two stages; ``benchmarks/pipeline.py`` measures the
step time this left).
"""

from __future__ import annotations

from collections import deque
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
    """Posted sends per destination, numbered by message (a message may be several sends: a
    header, a tensor); released in order, by message count, since the last ``drain``."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._held: dict[int, deque[tuple[dist.Work, torch.Tensor, int, str, int]]] = {}
        self._messages: dict[int, int] = {}  # messages posted to each destination
        self._sends = self._bytes = self._peak_sends = self._peak_bytes = 0

    def add(self, work: dist.Work, tensor: torch.Tensor, dst: int, what: str, last: bool) -> None:
        """Hold ``tensor`` until ``work`` (its send to ``dst``) is released; ``last``: it ends
        a message."""
        index = self._messages.get(dst, 0)
        if last:
            self._messages[dst] = index + 1
        nbytes = tensor.numel() * tensor.element_size()
        self._held.setdefault(dst, deque()).append((work, tensor, nbytes, what, index))
        self._sends += 1
        self._bytes += nbytes
        self._peak_sends = max(self._peak_sends, self._sends)
        self._peak_bytes = max(self._peak_bytes, self._bytes)

    def release(self, dst: int, count: int) -> tuple[str, str] | None:
        """Wait on (and drop) the sends of the first ``count`` messages to ``dst``; (what, why)
        of one that failed, None if all went out."""
        held = self._held.get(dst)
        while held and held[0][4] < count:
            work, tensor, nbytes, what, _ = held.popleft()
            del tensor  # freed here, before the step ends
            self._sends -= 1
            self._bytes -= nbytes
            cause = _wait(work, self.timeout)
            if cause:
                return what, cause
        return None

    def drain(self) -> tuple[str, str] | None:
        """Wait on every send; (what, why) of one that failed, None if all went out. Message
        numbers start again from 0."""
        failed = None
        for dst in list(self._held):
            got = self.release(dst, 1 << 62)
            failed = failed or got
        self._held, self._messages = {}, {}
        return failed

    def held(self) -> Held:
        return Held(self._sends, self._bytes, self._peak_sends, self._peak_bytes)

    def reset_peak(self) -> None:
        self._peak_sends, self._peak_bytes = self._sends, self._bytes


def _wait(work: dist.Work, timeout: timedelta) -> str:
    """Why ``work`` failed ('' if it completed)."""
    try:
        if work.wait(timeout=timeout) is False:
            return "timed out"
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return ""
