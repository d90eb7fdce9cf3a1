"""Background saves: ``rt.save(..., background=True)`` returns once the state is in host memory.

The part of a save that must see the training state as it is now runs before returning: the
plan's all-gather (sharded) or the consolidation (one file), and a copy of every tensor this
rank writes into host memory (pinned on CUDA, so the copies are asynchronous and one
synchronisation ends them). The files are written by a thread, which then meets the other
ranks on a process group of its own (Gloo, made once, by every rank at its first background
save, in the same order): its collectives never interleave with the training's on the default
group. It runs at a lower CPU priority (Linux), so the training's threads come first. One save is in flight at a time: the next save, ``PendingSave.wait()``,
``rw.shutdown()`` and the interpreter's exit (the thread is not a daemon) wait for it. A rank
killed while the thread writes leaves the temporary folder or file, never a half checkpoint:
``latest`` keeps naming the previous save.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import torch

from .. import runtime
from ..comm import collectives as comm
from ..job.process_group import new_group
from . import files, single
from .sharded import save as sharded_save

_NICENESS = 10
"""How much lower the writing thread's CPU priority is than the training's (``nice``)."""


class PendingSave:
    """A save being written in the background: ``wait()`` returns its path (or raises what
    made it fail), ``done()`` says whether it has finished."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None

    def _run(self, work: Any) -> None:
        # Lower this thread's CPU priority (Linux: per thread): the training's own threads
        # come first, the write takes what is left.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICENESS)
        try:
            self._path = work()
        except BaseException as exc:  # kept for wait(); told at once, too
            self._error = exc
            from ..output.log import get_logger

            get_logger().error(f"background checkpoint save to {self.target!r} failed: {exc}")

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until written; the path, or the save's error. No sync point."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._path  # type: ignore[return-value]


class _Saves:
    """The one save in flight in this process, and the group its thread talks on (the
    process group is per process, and so is this)."""

    def __init__(self) -> None:
        self.pending: PendingSave | None = None
        self.group: Any = None
        self.hooked = False

    def wait(self) -> None:
        """Wait for the save in flight; its error (if any) is raised here, once."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def at_shutdown(self) -> None:
        pending, self.pending, self.group = self.pending, None, None
        if pending is not None:
            with contextlib.suppress(Exception):  # logged when it failed; shutdown goes on
                pending.wait()

    def save_group(self) -> Any:
        """The background saves' own group (Gloo: the thread moves JSON bytes, on the CPU).
        Sync point: all ranks, the first time."""
        if not self.hooked:  # rw.shutdown() waits for the save in flight, first of all
            runtime.on_shutdown(self.at_shutdown, always=True, first=True)
            self.hooked = True
        if comm.world_size() == 1:
            return None
        if self.group is None:
            rt = runtime.get_runtime() if runtime.is_initialized() else None
            # The job's timeout, else the default group's own (never torch's 30 minutes).
            self.group = new_group(backend="gloo", timeout=rt.timeout if rt is not None else None)
        return self.group


SAVES = _Saves()


def stage(data: dict[int, Any]) -> None:
    """Replace every tensor in ``data`` by a host copy (pinned, asynchronous, on CUDA)."""
    on_cuda = False
    for i, value in data.items():
        if isinstance(value, torch.Tensor):
            pin = value.is_cuda
            on_cuda |= pin
            out = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
            out.copy_(value.detach(), non_blocking=pin)
            data[i] = out
    if on_cuda:
        torch.cuda.synchronize()


def snapshot(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (what rank 0 writes, frozen now)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    return value


def save_in_background(
    path: str | os.PathLike, *, sharded: bool, model: Any, optimizer: Any = None,
    scheduler: Any = None, loader: Any = None, step: int | None = None, epoch: Any = None,
    keep_last: int = 3, **extra: Any,
) -> PendingSave:  # fmt: skip
    """Stage now, write in a thread. Sync point: all ranks (the previous save is waited for,
    the plan or the consolidation is collective)."""
    files.check_arguments(path, model, optimizer, saving=True, epoch=epoch, keep_last=keep_last)
    SAVES.wait()
    group = SAVES.save_group()
    if sharded:
        plan = sharded_save.plan(path, model=model, optimizer=optimizer, scheduler=scheduler,
                                 loader=loader, step=step, epoch=epoch, keep_last=keep_last,
                                 extra=extra)  # fmt: skip
        stage(plan.data)
        work = lambda: sharded_save.finish(plan, group=group)  # noqa: E731
    else:
        payload = single.prepare(model, optimizer, scheduler, loader, step, epoch, keep_last,
                                 extra)  # fmt: skip
        frozen = snapshot(payload)
        work = lambda: single.finish(Path(path), keep_last, frozen, step, group=group)  # noqa: E731
    pending = PendingSave(os.fspath(path))
    pending._thread = threading.Thread(
        target=pending._run, args=(work,), name="rankwise-background-save", daemon=False
    )
    SAVES.pending = pending
    pending._thread.start()
    return pending
