"""A schedule run in one process: one thread per device, queues in place of sends.

``rw.split(..., schedule=...)``'s ``train_step`` runs the same executor as the processes do
(``executor.py``), one thread per pipeline position, with a ``QueueTransport`` between them: a
queue per (sender, receiver) pair is first in, first out, like a point-to-point channel. torch
ops release the GIL (and on CUDA a thread only enqueues kernels), so the positions compute at
the same time. A thread that fails sets an abort flag; the others stop at their next receive
and the first failure is raised in the caller.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..schedules import Message, Schedule
from .executor import Executor, Stages, StepResult
from .weight_pass import WeightPass
from .wire import Header


class _Aborted(Exception):
    """Another position failed: this one stops too."""


class QueueTransport:
    """Tensors between positions of one process, by queue (no copy: the receiver moves it to
    its own device)."""

    def __init__(self, boxes: dict[tuple[int, int], queue.Queue], position: int,
                 abort: threading.Event) -> None:  # fmt: skip
        self.boxes, self.position, self.abort = boxes, position, abort

    def send(self, dst: int, msg: Message, tensor: torch.Tensor, header: Header | None) -> None:
        self.boxes[(self.position, dst)].put(tensor.detach())

    def post(self) -> None:
        pass

    def expect(self, src: int, msg: Message, like: torch.Tensor | None) -> None:
        pass

    def progress(self) -> None:
        pass

    def receive(self, src: int, msg: Message, like: torch.Tensor | None) -> torch.Tensor:
        box = self.boxes[(src, self.position)]
        while True:
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                if self.abort.is_set():
                    raise _Aborted() from None

    def acked(self, dst: int, count: int) -> None:
        pass  # nothing is held: the queue owns what was put in it

    def flush(self) -> None:
        pass


def run_in_threads(
    schedule: Schedule,
    stages: list[Stages],
    seed: Callable[[int], float],
    weight_passes: list[WeightPass | None],
    setup: Callable[[int], contextlib.AbstractContextManager | None] = lambda j: None,
) -> list[StepResult]:
    """Every position's actions, each in its thread; their results in position order.
    ``setup(j)``: thread-local state entered in position ``j``'s thread (streams, autocast)."""
    p = schedule.ranks
    boxes = {(a, b): queue.Queue() for a in range(p) for b in range(p) if a != b}
    abort = threading.Event()
    results: list[Any] = [None] * p
    failures: list[BaseException] = []

    def work(j: int) -> None:
        try:
            with setup(j) or contextlib.nullcontext():
                executor = Executor(schedule, j, stages[j], QueueTransport(boxes, j, abort),
                                    seed=seed, weight_pass=weight_passes[j])  # fmt: skip
                results[j] = executor.run()
        except _Aborted:
            pass
        except BaseException as exc:  # re-raised in the caller once every thread has ended
            failures.append(exc)
            abort.set()

    threads = [threading.Thread(target=work, args=(j,), name=f"rankwise-pipe-position{j}",
                                daemon=True) for j in range(p)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results
