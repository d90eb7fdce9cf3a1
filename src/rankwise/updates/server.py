"""The parameter server: it holds the parameters and a copy of the user's optimizer, and applies
each gradient as it arrives (or, under a staleness bound, as soon as the bound allows).

It runs in background threads of the server rank: one loop thread that owns all state, and one
receiver thread per remote worker that turns blocking Gloo receives into queue items (a receive
from one named peer is how Gloo reports that this peer died; a receive from "any source" is not).
Rank 0's own training thread, when it trains too, talks to the loop through queues.

Timeouts measure the silence of whoever is being waited for, never a legitimate wait:

- a receiver only listens for a worker's next message after the server has replied to it, so
  its timeout measures the worker's own silence between two steps (rank 0's own worker is
  watched by the loop with the same limit);
- a worker held back by the staleness bound, or waiting at ``close()`` for slower workers to
  finish, receives a WAIT heartbeat every ``timeout / 4``, so its own timeout measures the
  server's silence, and a long wait for a live, slow worker is not an error.

A worker waits for its reply as soon as it has sent its request, so a reply that cannot be
delivered for ``stall_timeout`` seconds (8 by default, looked for twice a second: dropped within
10 s; much less than ``timeout``) means that worker stopped receiving (stopped with SIGSTOP, held in a debugger, not a rankwise worker): it
is *dropped*, and the others train on without it. If it comes back, its next request is
answered with STOP.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..comm.flat import FlatParams
from .gate import Applied, StalenessGate
from .protocol import TO_SERVER, Kind, Message, ProtocolError, WireChannel, text_message
from .senders import Sender

_log = logging.getLogger("rankwise.updates")


@dataclass(frozen=True)
class ServerStats:
    """What the server applied, and how late. Read it on the server rank."""

    staleness_bound: int | None
    """The bound ``s`` the server enforced (None: none)."""
    updates: int
    """Optimizer steps applied (one per batch of gradients released together)."""
    gradients: int
    """Gradients applied (each worker step pushes one)."""
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    """Staleness -> number of gradients applied with it."""
    gradients_by_worker: dict[int, int] = field(default_factory=dict)
    """Worker rank -> number of its gradients applied."""
    dropped: dict[int, str] = field(default_factory=dict)
    """Worker rank -> why it was dropped (it stopped receiving; the others trained on)."""

    @property
    def max_staleness(self) -> int:
        return max(self.staleness_histogram, default=0)


class ParameterServer:
    """Serves ``workers`` from the current rank; call ``start()``, then ``join()`` at the end."""

    def __init__(
        self,
        *,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        workers: list[int],
        local_worker: int | None,
        channel: WireChannel | None,
        bound: int | None,
        rank: int,
        timeout: float,
        stall_timeout: float = 8.0,
    ) -> None:
        self._flat = FlatParams(params)
        self._opt = optimizer
        self._gate = StalenessGate(workers, bound)
        self._workers = sorted(workers)
        self._local = local_worker
        self._channel = channel
        self._rank = rank
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.local_replies: queue.Queue[Message] = queue.Queue()
        self._go = {r: queue.Queue() for r in self._workers if r != local_worker}
        self._senders: dict[int, Sender] = {}
        self._deaf: set[int] = set()  # workers whose reply could not be delivered (dropped)
        self._dropped: dict[int, str] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._waiting: dict[int, Kind] = {}  # worker -> request still without a reply
        self._done: set[int] = set()
        self._finished: set[int] = set()
        self._failure: Message | None = None
        self._lock = threading.Lock()
        self._hist: Counter[int] = Counter()
        self._by_worker: Counter[int] = Counter()
        self._updates = 0
        self._threads: list[threading.Thread] = []
        self._timeout = timeout
        self._stall = stall_timeout
        self._heartbeat = timeout / 4
        self._check_every = max(0.05, min(0.5, stall_timeout / 4))  # how often deafness is looked for
        self._local_since = time.monotonic()  # when the local worker last got a reply
        # Rank 0's training thread hands CUDA gradients to the loop and reads the parameters it
        # sends back: both threads queue their kernels on the stream current here (the training
        # thread's), so every hand-over is stream-ordered (docs/updates.md, CUDA streams).
        device = self._flat.device
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        for r in self._go:
            self._spawn(self._receive, r, name=f"rankwise-ps-recv{r}")
            self._senders[r] = Sender(self._channel, r, self._send_failed)
        self._loop = self._spawn(self._serve, name="rankwise-ps")

    def _spawn(self, target, *args, name: str) -> threading.Thread:
        # Daemon: at interpreter exit, Python joins non-daemon threads BEFORE atexit handlers,
        # and our atexit handler is what tells the server to stop.
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def join(self, timeout: float) -> bool:
        """Wait for the server loop to end; True when it did."""
        self._loop.join(timeout)
        return not self._loop.is_alive()

    @property
    def failure(self) -> Message | None:
        """The STOP sent to every worker after a failure (its rank and reason), else None."""
        return self._failure

    def values(self) -> torch.Tensor:
        """The server's current parameters (the final ones once ``join`` returned True)."""
        return self._flat.values()

    def stats(self) -> ServerStats:
        with self._lock:
            return ServerStats(
                staleness_bound=self._gate.bound,
                updates=self._updates,
                gradients=sum(self._hist.values()),
                staleness_histogram=dict(sorted(self._hist.items())),
                gradients_by_worker=dict(sorted(self._by_worker.items())),
                dropped=dict(sorted(self._dropped.items())),
            )

    # ---- threads -----------------------------------------------------------------------------
    def _receive(self, worker: int) -> None:
        try:
            while True:
                try:
                    msg = self._channel.recv(worker, TO_SERVER)
                except ProtocolError as exc:
                    # The job ends; keep listening once more for the BYE that follows our STOP.
                    msg = text_message(Kind.BAD, worker, exc.message)
                self.inbox.put(msg)
                if msg.kind in (Kind.DONE, Kind.ABORT, Kind.BYE) or not self._go[worker].get():
                    return
        except Exception as exc:  # a timeout or a vanished peer: both end this worker
            first = str(exc).splitlines()[0] if str(exc) else ""
            text = f"lost contact with worker rank {worker} ({type(exc).__name__}: {first})"
            self.inbox.put(text_message(Kind.LOST, worker, text))

    def _serve(self) -> None:
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)  # this thread's own setting; it ends with it
        next_beat = time.monotonic() + self._heartbeat
        next_check = time.monotonic() + self._check_every
        while len(self._finished) < len(self._workers):
            wait = min(next_beat, next_check) - time.monotonic()
            try:
                msg = self.inbox.get(timeout=max(0.0, wait))
            except queue.Empty:
                msg = None
            try:
                if msg is not None:
                    self._handle(msg)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + self._check_every
                    self._check_deaf(now)
                if now >= next_beat:
                    next_beat = now + self._heartbeat
                    self._beat()
            except Exception as exc:
                if self._failure is None:
                    text = (
                        f"the parameter server on rank {self._rank} failed with "
                        f"{type(exc).__name__}: {exc}"
                    )
                    self._fail(text_message(Kind.STOP, self._rank, text))
        for go in self._go.values():  # release receivers still waiting for a go-ahead
            go.put(False)
        self._flush()

    def _flush(self) -> None:
        """Deliver the last replies (final PARAMS, STOP) before the caller tears the group down;
        a worker that stopped receiving is not waited for."""
        deadline = time.monotonic() + self._timeout
        for w, sender in self._senders.items():
            sender.close()
            if w not in self._deaf:
                sender.thread.join(max(0.0, deadline - time.monotonic()))

    def _send_failed(self, w: int, why: str) -> None:
        self.inbox.put(text_message(Kind.LOST, w, f"lost contact with worker rank {w} ({why})"))

    def _beat(self) -> None:
        """Tell waiting workers the server is alive; notice a silent local worker."""
        for w in sorted(self._waiting):
            if w == self._local or self._senders[w].pending == 0:
                self._send(w, Message(Kind.WAIT, w, self._gate.version))
        local = self._local
        silent = time.monotonic() - self._local_since
        busy = local is not None and local not in self._waiting and local not in self._finished
        if busy and silent > self._timeout:
            text = (
                f"lost contact with worker rank {local} (no step for {silent:.0f}s, "
                f"timeout {self._timeout:.0f}s)"
            )
            self.inbox.put(text_message(Kind.LOST, local, text))

    def _check_deaf(self, now: float) -> None:
        """Drop a remote worker whose reply has waited ``stall_timeout`` s for it to receive."""
        for w, sender in self._senders.items():
            stalled = sender.stalled_for(now)
            if stalled > self._stall and w not in self._deaf and w not in self._finished:
                self._deaf.add(w)
                self._drop(
                    w,
                    f"worker rank {w} stopped receiving: its reply has waited {stalled:.0f}s "
                    f"(stall_timeout {self._stall:g}s); it is stopped, held in a debugger, or "
                    "not a rankwise worker",
                )

    def _drop(self, w: int, why: str) -> None:
        """Train on without ``w``: it no longer holds the others back, its held gradient is
        discarded, and a request it sends later is answered with STOP."""
        self._dropped[w] = why
        self._finished.add(w)
        self._waiting.pop(w, None)
        self._grads.pop(w, None)
        others = ", ".join(str(r) for r in self._workers if r not in self._dropped)
        _log.warning("rankwise parameter server: dropped %s; training goes on with rank(s) %s",
                     why, others or "none")  # fmt: skip
        self._apply(self._gate.drop(w))
        if self._done and self._done | set(self._dropped) == set(self._workers):
            self._finish()

    # ---- the protocol ------------------------------------------------------------------------
    def _handle(self, msg: Message) -> None:
        w, kind = msg.rank, msg.kind
        if w in self._dropped:
            if kind in (Kind.PULL, Kind.PUSH, Kind.DONE):  # it came back: tell it it is out
                self._waiting[w] = kind
                self._reply(w, text_message(Kind.STOP, w, f"{self._dropped[w]}; it was dropped "
                                            "and the others trained on without it"))  # fmt: skip
            return
        if kind == Kind.PUSH and msg.version > self._gate.version:
            bad = ProtocolError(w, "version", msg.version, f"at most {self._gate.version}")
            msg, kind = text_message(Kind.BAD, w, bad.message), Kind.BAD
        if kind == Kind.PUSH and not bool(torch.isfinite(msg.payload).all()):
            msg, kind = text_message(Kind.BAD, w, _non_finite(w, msg)), Kind.BAD
        if kind == Kind.BAD and w in self._finished:
            return  # already stopped: more garbage from it changes nothing
        if kind == Kind.BAD:
            # The offender waits for a reply to what it sent: it is stopped too (last, so
            # that a peer that never receives cannot delay the others), and not waited for.
            self._waiting[w] = Kind.PUSH
            if self._failure is None:
                self._fail(text_message(Kind.STOP, w, msg.text))
            else:
                self._stop(w)
            self._finished.add(w)
        elif kind == Kind.BYE:
            self._finished.add(w)
        elif kind in (Kind.ABORT, Kind.LOST):
            self._finished.add(w)
            self._waiting.pop(w, None)
            text = msg.text if kind == Kind.LOST else f"worker rank {w} failed with {msg.text}"
            if self._failure is None:
                self._fail(text_message(Kind.STOP, w, text))
        elif self._failure is not None:
            self._waiting[w] = kind
            self._stop(w)
        elif kind == Kind.PULL:
            version = self._gate.start(w)
            self._waiting[w] = kind
            self._reply(w, Message(Kind.PARAMS, w, version, 0, self._flat.values()))
        elif kind == Kind.PUSH:
            self._grads[w] = msg.payload
            self._waiting[w] = kind
            self._apply(self._gate.push(w))
        elif kind == Kind.DONE:
            self._done.add(w)
            self._waiting[w] = kind
            self._apply(self._gate.leave(w))
            if self._done | set(self._dropped) == set(self._workers):
                self._finish()

    def _apply(self, batch: list[Applied]) -> None:
        """One optimizer step with the released gradients, each weighted 1/num_workers."""
        if not batch:
            return
        total: torch.Tensor | None = None
        for a in batch:  # rank order: the same sum on every run
            g = self._grads.pop(a.worker).to(self._flat.device)
            total = g.clone() if total is None else total.add_(g)
        total.div_(len(self._workers))
        self._flat.load_grads(total)
        self._opt.step()
        with self._lock:
            self._updates += 1
            self._hist.update(a.staleness for a in batch)
            self._by_worker.update(a.worker for a in batch)
        values = self._flat.values()
        for a in batch:
            reply = Message(Kind.PARAMS, a.worker, self._gate.version, a.staleness, values)
            self._reply(a.worker, reply)

    def _finish(self) -> None:
        values = self._flat.values()
        for w in sorted(self._done):
            self._reply(w, Message(Kind.PARAMS, w, self._gate.version, 0, values))

    def _fail(self, stop: Message) -> None:
        self._failure = stop
        for w in sorted(self._waiting, key=lambda r: (r == stop.rank, r)):
            self._stop(w)

    def _stop(self, w: int) -> None:
        self._reply(w, self._failure._replace(payload=None))

    def _reply(self, w: int, msg: Message) -> None:
        """Answer ``w``'s outstanding request; after a DONE or a STOP-to-DONE it is finished."""
        request = self._waiting.pop(w)
        last = request == Kind.DONE
        if last:
            self._finished.add(w)
        if w == self._local:
            self._local_since = time.monotonic()
        if self._send(w, msg) and not last and w != self._local:
            self._go[w].put(True)  # it will send again: PUSH or DONE after PARAMS, BYE after STOP

    def _send(self, w: int, msg: Message) -> bool:
        """Queue a reply to a waiting worker; never waits for delivery (``senders``). A worker
        that cannot be reached, or stops receiving, comes back as LOST and ends the run."""
        if w == self._local:
            self.local_replies.put(msg)
        else:  # to a dropped worker too: queued behind its stuck reply, sent if it comes back
            self._senders[w].put(msg)
        return True


def _non_finite(w: int, push: Message) -> str:
    """Why a push with NaN/Inf is refused: applied, it would make every replica NaN."""
    bad = int((~torch.isfinite(push.payload)).sum())
    return (
        f"worker rank {w} pushed non-finite gradients ({bad} of {push.payload.numel()} "
        f"elements NaN or Inf, computed on version {push.version}); refused, not applied. Fix: "
        "find the step whose loss is not finite (lower the learning rate, clip gradients, "
        "check the inputs)"
    )
