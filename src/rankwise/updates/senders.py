"""The parameter server's replies, sent by one thread per remote worker.

On Gloo a send returns only once the peer has posted the matching receive. Sent from the
server's loop thread, a reply to a worker that pushed and then stopped receiving (stopped with
SIGSTOP, held in a debugger, or not a rankwise worker at all) would freeze the loop, and with
it rank 0's own training and every other worker, until the timeout. Each remote worker gets a
``Sender`` instead: the loop queues the reply and goes on; the loop's heartbeat asks every
sender how long its current send has waited (``stalled_for``) and reports a worker that stops
receiving for longer than the timeout, while the others train on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from .protocol import Message, WireChannel


class Sender:
    """Delivers one worker's replies in order; never blocks whoever calls ``put``."""

    def __init__(
        self, channel: WireChannel, worker: int, on_error: Callable[[int, str], None]
    ) -> None:
        self._channel, self.worker, self._on_error = channel, worker, on_error
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._pending = 0  # queued or being sent (only this thread decrements)
        self._since: float | None = None  # when the send in progress started
        self._lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._run, name=f"rankwise-ps-send{worker}", daemon=True
        )
        self.thread.start()

    def put(self, msg: Message) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put(msg)

    @property
    def pending(self) -> int:
        """Replies queued or in flight (a heartbeat is pointless while one is)."""
        return self._pending

    def stalled_for(self, now: float) -> float:
        """Seconds the send in progress has waited for the worker to receive (0: none)."""
        since = self._since
        return 0.0 if since is None else now - since

    def close(self) -> None:
        """Send what is queued, then end."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            self._since = time.monotonic()
            try:
                self._channel.send(self.worker, msg)
            except Exception as exc:  # a vanished peer: the loop ends the run naming it
                self._on_error(self.worker, f"{type(exc).__name__}: {exc}")
                return
            finally:
                self._since = None
                with self._lock:
                    self._pending -= 1
