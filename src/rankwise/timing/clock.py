"""The step clock of this process: where each training step's time goes, phase by phase.

The engines mark their own phases (``span("forward")``, ``span("blocked")`` around a wait for
peers, ``bucket_ready()`` when a gradient bucket is complete); the session marks the data wait,
the optimizer and checkpoints; ``finish_step()`` (the optimizer's step hook) closes the step.
Spans are *exclusive*: a span opened inside another pauses the outer one, so ``backward`` holds
only computation when the reducer's wait for peers inside it is a ``blocked`` span.

Clocks: ``time.perf_counter`` on the host. On a GPU a compute span launched on the device
returns long before the device is done, so ``forward``/``backward`` are also timed with CUDA
events on the steps that are gathered (``DeviceSpans``); the events are read once, at the end
of such a step. Only the thread that made the clock (the training loop's) marks anything:
``DataParallel``'s replica threads and pipeline worker threads run inside the caller's span.

Costs: a few perf_counter calls per span, no allocation on the hot path; nothing here
communicates. One clock per process (``current()``), as the collective fingerprints keep
one recorder per process: the engines find it without being handed it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PHASES = ("data", "forward", "backward", "blocked", "optimizer", "checkpoint")
"""What the clock measures. ``blocked``: inside a collective after this rank was ready (the
own communication plus the wait for peers, told apart across ranks in ``record``)."""

DEVICE_PHASES = ("forward", "backward")
"""Phases whose work a GPU runs after the host returns: timed with CUDA events there."""


@dataclass
class StepSample:
    """One finished step on this rank, in seconds (``phases`` by name)."""

    phases: dict[str, float]
    total: float
    cpu: float | None
    """CPU seconds of the loop's thread during the step, outside its waits for peers (Gloo
    polls while it waits): low against the busy time on a host whose CPU is throttled. Read
    on armed steps only (None elsewhere): each read is a system call, several per step."""
    lag: float
    """Seconds from this rank's arrival at the step's longest wait for peers to its end: the
    rank that arrives last has the smallest lag (its peers waited for it)."""
    ready_lag: float
    """Seconds from the first gradient bucket ready (or the arrival) to that same end."""

    @property
    def other(self) -> float:
        return max(0.0, self.total - sum(self.phases.values()))


class DeviceSpans:
    """CUDA event pairs for the device phases of one step (``armed`` steps only)."""

    def __init__(self) -> None:
        self.pairs: dict[str, list[tuple[Any, Any]]] = {}
        self.open: dict[str, Any] = {}
        self.last_end: Any = None  # the end event of the phase that stopped last

    def start(self, phase: str, at_last_end: bool = False) -> None:
        """``at_last_end``: the phase began when the last one ended (the backward, from the
        forward's end: its first hook fires after the loss's own backward, whose kernels the
        device runs before it, and which the host time counts too)."""
        import torch

        if at_last_end and self.last_end is not None:
            self.open[phase] = self.last_end
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.open[phase] = ev

    def stop(self, phase: str) -> None:
        import torch

        start = self.open.pop(phase, None)
        if start is None:
            return
        end = self.last_end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.setdefault(phase, []).append((start, end))

    def seconds(self) -> dict[str, float]:
        """Device seconds per phase; waits for the last event (once per armed step)."""
        out = {}
        for phase, pairs in self.pairs.items():
            pairs[-1][1].synchronize()
            out[phase] = sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
        self.pairs.clear()
        self.last_end = None
        return out


class StepClock:
    """Phase times of the step under way; ``finish_step`` returns them and starts the next."""

    def __init__(self, *, device_type: str = "cpu") -> None:
        self.owner = threading.get_ident()
        self.device_type = device_type
        self.armed = False
        """Time device phases with CUDA events, and the thread's CPU seconds, this step (set
        for the steps that are gathered: ``arm``)."""
        self.device = DeviceSpans() if device_type == "cuda" else None
        self.step = 0
        """Steps finished so far (what a hang report's event names)."""
        self._restart(time.perf_counter())

    def arm(self, armed: bool) -> None:
        """Whether the step now starting is measured in full (see ``armed``)."""
        self.armed = armed
        self.cpu0 = time.thread_time() if armed else None

    def _restart(self, now: float) -> None:
        self.start = now
        self.cpu0: float | None = None  # the thread's CPU seconds at the start (armed steps)
        self.cpu_blocked = 0.0  # the loop thread's CPU seconds inside its blocked spans
        self._cpu_since: float | None = None
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.stack: list[list[Any]] = []  # [phase, since] of the open spans, innermost last
        self.last = now  # the last time a span opened or closed
        self.arrived: float = 0.0
        self.synced: float | None = None  # the longest blocked span of the step, if any
        self._blocked_since: float | None = None
        self.first_ready: float | None = None

    def mine(self) -> bool:
        return threading.get_ident() == self.owner

    def push(self, phase: str, since: float | None = None) -> None:
        """Open ``phase`` now, or at ``since`` when no span has opened or closed after it
        (the backward, from the end of the forward: the loss and its own backward count)."""
        now = time.perf_counter()
        if self.stack:  # the outer span pauses
            outer = self.stack[-1]
            self.phases[outer[0]] += now - outer[1]
        start = now if since is None or self.stack or since < self.last else since
        self.last = now
        self.stack.append([phase, start])
        if phase == "blocked":
            self._blocked_since = now
            if self._cpu_since is None and self.cpu0 is not None and self.mine():
                self._cpu_since = time.thread_time()
        elif self.armed and self.device is not None and phase in DEVICE_PHASES:
            self.device.start(phase, at_last_end=since is not None and start == since)

    def pop(self, phase: str) -> None:
        now = self.last = time.perf_counter()
        while self.stack:  # a span left open by an exception is closed with its parent
            name, since = self.stack.pop()
            self.phases[name] += now - since
            if name == phase:
                break
        if self.stack:
            self.stack[-1][1] = now
        if phase == "blocked" and self._blocked_since is not None:
            # The step's longest wait is its sync with the slowest peer: its arrival counts.
            if self.synced is None or now - self._blocked_since > self.synced - self.arrived:
                self.arrived, self.synced = self._blocked_since, now
            self._blocked_since = None
            if self._cpu_since is not None and self.mine() and not self._in_blocked():
                self.cpu_blocked += time.thread_time() - self._cpu_since
                self._cpu_since = None
        elif self.armed and self.device is not None and phase in DEVICE_PHASES:
            self.device.stop(phase)

    def _in_blocked(self) -> bool:
        return any(name == "blocked" for name, _ in self.stack)

    def bucket_ready(self) -> None:
        """A gradient bucket of this pass is complete (the first one starts ``ready_lag``)."""
        if self.first_ready is None:
            self.first_ready = time.perf_counter()

    def finish_step(self) -> StepSample:
        """Close the step now (every open span ends here) and start the next one."""
        now = time.perf_counter()
        for name, since in self.stack:
            self.phases[name] += now - since  # only the innermost is running; see push
            break
        phases = dict(self.phases)
        if self.armed and self.device is not None:
            phases.update(self.device.seconds())
        synced = self.synced if self.synced is not None else now
        arrived = self.arrived if self.synced is not None else synced
        first = min(self.first_ready or arrived, arrived)
        cpu = (
            None
            if self.cpu0 is None
            else max(0.0, time.thread_time() - self.cpu0 - self.cpu_blocked)
        )
        sample = StepSample(phases, now - self.start, cpu,
                            max(0.0, synced - arrived), max(0.0, synced - first))  # fmt: skip
        self.step += 1
        reopen = [name for name, _ in self.stack]
        self._restart(now)
        self.stack = [[name, now] for name in reopen]
        return sample


_clock: StepClock | None = None


def current() -> StepClock | None:
    """This process's clock, or None when step timing is off."""
    return _clock


def install(clock: StepClock | None) -> None:
    """Make ``clock`` this process's clock (None: timing off)."""
    global _clock
    _clock = clock


@contextlib.contextmanager
def span(phase: str, *, any_thread: bool = False) -> Iterator[None]:
    """Time the block as ``phase`` on this process's clock (nothing when off, or on another
    thread unless ``any_thread``: autograd runs a GPU's backward hooks on its own thread while
    the loop's thread waits in ``backward()``). Exclusive: an outer span pauses meanwhile."""
    clock = _clock
    if clock is None or not (any_thread or clock.mine()):
        yield
        return
    clock.push(phase)
    try:
        yield
    finally:
        clock.pop(phase)


def begin(phase: str, *, any_thread: bool = False, since: float | None = None) -> None:
    """``span`` split in two, for hooks that open and close in different calls."""
    clock = _clock
    if clock is not None and (any_thread or clock.mine()):
        clock.push(phase, since)


def end(phase: str, *, any_thread: bool = False) -> None:
    clock = _clock
    if clock is not None and (any_thread or clock.mine()):
        clock.pop(phase)


def bucket_ready() -> None:
    """A gradient bucket became ready (the reducer's hook, the sharded engine's)."""
    clock = _clock
    if clock is not None:  # any thread: a GPU's autograd thread runs the hooks
        clock.bucket_ready()
