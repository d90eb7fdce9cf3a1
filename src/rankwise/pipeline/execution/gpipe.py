"""The GPipe forward schedule, run for real: one worker thread per stage, queues between them.

Stage ``j`` takes micro-batch ``i`` from its input queue, runs its layers and puts the result
in stage ``j+1``'s queue. So at clock tick ``k`` stage ``j`` works on micro-batch ``k - j``:
the stages work at the same time on different micro-batches, and the only idle time is the
fill and drain of the pipe, the bubble ``(p-1)/(m+p-1)`` of GPipe (Huang et al., 2019).

Threads are enough for overlap because torch ops release the GIL while they compute (and on
CUDA a thread only enqueues kernels). Every run records which stage ran which micro-batch and
when (``ScheduleEvent``), so tests can check the order and the overlap, and benchmarks can
measure the bubble instead of assuming it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

StageFn = Callable[[int, torch.Tensor], torch.Tensor]
"""``fn(micro_batch_index, activation) -> activation`` of one stage."""


@dataclass(frozen=True)
class ScheduleEvent:
    """One stage running one micro-batch (times from ``time.perf_counter``)."""

    stage: int
    micro_batch: int
    start: float
    end: float


def gpipe_clock(num_micro_batches: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """The ideal GPipe forward: for each clock tick, the (stage, micro_batch) pairs that run."""
    ticks = num_micro_batches + num_stages - 1
    return [
        [(j, k - j) for j in range(num_stages) if 0 <= k - j < num_micro_batches]
        for k in range(ticks)
    ]


def bubble_fraction(num_micro_batches: int, num_stages: int) -> float:
    """GPipe's idle fraction for equal stages: ``(p-1)/(m+p-1)``."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def measured_bubble(events: Sequence[ScheduleEvent]) -> float:
    """Idle fraction of a recorded run: 1 - (busy stage time) / (stages x wall span)."""
    if not events:
        return 0.0
    stages = {e.stage for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (len(stages) * span)) if span > 0 else 0.0


def run_sequential(
    stages: Sequence[StageFn], micro_batches: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[ScheduleEvent]]:
    """Every micro-batch through every stage in the caller's thread (1 stage or 1 micro-batch)."""
    events, outputs = [], []
    for i, x in enumerate(micro_batches):
        for j, fn in enumerate(stages):
            start = time.perf_counter()
            x = fn(i, x)
            events.append(ScheduleEvent(j, i, start, time.perf_counter()))
        outputs.append(x)
    return outputs, events


class _Failure:
    """A stage's exception travelling down the queues, so every later stage stops too."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _worker(
    j: int,
    fn: StageFn,
    inbox: queue.Queue,
    outbox: queue.Queue,
    events: list[ScheduleEvent],
    setup: Callable[[int], contextlib.AbstractContextManager | None],
) -> None:
    # setup may return a context (the caller's streams, autocast) held for the thread's life.
    # If it fails, the stage still passes the end marker on, so the caller never waits forever.
    try:
        context = setup(j) or contextlib.nullcontext()
    except BaseException as exc:
        outbox.put(_Failure(exc))
        _serve(j, fn, inbox, outbox, events, broken=True)
        return
    with context:
        _serve(j, fn, inbox, outbox, events, broken=False)


def _serve(
    j: int,
    fn: StageFn,
    inbox: queue.Queue,
    outbox: queue.Queue,
    events: list[ScheduleEvent],
    broken: bool,
) -> None:
    # After a failure, later micro-batches are dropped: the batch is lost anyway.
    while True:
        item = inbox.get()
        if item is None or isinstance(item, _Failure):
            outbox.put(item)
            if item is None:
                return
            continue
        if broken:
            continue
        i, x = item
        start = time.perf_counter()
        try:
            y = fn(i, x)
        except BaseException as exc:  # handed to the caller's thread, which re-raises it
            outbox.put(_Failure(exc))
            broken = True
            continue
        events.append(ScheduleEvent(j, i, start, time.perf_counter()))
        outbox.put((i, y))


def run_pipelined(
    stages: Sequence[StageFn],
    micro_batches: Sequence[torch.Tensor],
    setup: Callable[[int], contextlib.AbstractContextManager | None] = lambda j: None,
) -> tuple[list[torch.Tensor], list[ScheduleEvent]]:
    """Run micro-batches through stages in GPipe order, one thread per stage.

    ``setup(j)`` runs first in stage ``j``'s thread (thread-local state such as grad mode and
    the current CUDA device and stream); a context manager it returns stays entered until the
    thread ends. Returns the last stage's outputs in micro-batch order and the
    recorded events. The first exception of any stage is re-raised here, after every thread
    has ended, so no thread outlives the call.
    """
    boxes = [queue.Queue() for _ in range(len(stages) + 1)]
    events: list[ScheduleEvent] = []
    threads = [
        threading.Thread(
            target=_worker,
            args=(j, fn, boxes[j], boxes[j + 1], events, setup),
            name=f"rankwise-pipe-stage{j}",
            daemon=True,
        )
        for j, fn in enumerate(stages)
    ]
    for t in threads:
        t.start()
    for i, x in enumerate(micro_batches):
        boxes[0].put((i, x))
    boxes[0].put(None)
    outputs: list[torch.Tensor] = []
    failure: BaseException | None = None
    while (item := boxes[-1].get()) is not None:
        if isinstance(item, _Failure):
            failure = failure or item.exc
        else:
            outputs.append(item[1])
    for t in threads:
        t.join()
    if failure is not None:
        raise failure
    return outputs, events
