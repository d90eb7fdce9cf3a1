"""Run each replica on its own inputs in its own thread; re-raise a replica's error, tagged.

Threads, not processes: DataParallel is one process, so the replicas share the master
parameters and the autograd graph. PyTorch releases the GIL inside its kernels, so replicas on
different devices (or on several CPU cores) run concurrently; the Python glue between kernels is
serialized by the GIL, which is DataParallel's known cost next to one process per device.

Thread-local state does not follow a new thread by itself, so each worker re-enters the
caller's grad mode, autocast state, device and current stream before running its replica.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import ConfigError


def _device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current device of this thread (a no-op for the CPU)."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    backend = torch.get_device_module(device.type)
    return backend.device(device) if hasattr(backend, "device") else contextlib.nullcontext()


def _caller_state(devices: Sequence[torch.device]) -> Callable[[int], contextlib.ExitStack]:
    """Capture the caller's thread-local state; return a factory that re-enters it for replica i."""
    grad = torch.is_grad_enabled()
    autocast = {
        d.type: (torch.is_autocast_enabled(d.type), torch.get_autocast_dtype(d.type))
        for d in devices
    }
    streams: list[Any] = []
    for d in devices:
        backend = None if d.type == "cpu" else torch.get_device_module(d.type)
        has_streams = backend is not None and hasattr(backend, "current_stream")
        streams.append(backend.current_stream(d) if has_streams else None)

    def enter(i: int) -> contextlib.ExitStack:
        d = devices[i]
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        stack.enter_context(_device_context(d))
        if streams[i] is not None:
            stack.enter_context(torch.get_device_module(d.type).stream(streams[i]))
        enabled, dtype = autocast[d.type]
        if enabled:  # a new thread starts with autocast off, so only "on" needs re-entering
            stack.enter_context(torch.autocast(d.type, dtype=dtype))
        return stack

    return enter


def parallel_apply(
    modules: Sequence[Callable[..., Any]],
    inputs: Sequence[tuple],
    kwargs: Sequence[dict[str, Any]] | None,
    devices: Sequence[torch.device | str],
) -> list[Any]:
    """Call ``modules[i](*inputs[i], **kwargs[i])`` on ``devices[i]``, one thread per replica.

    Replica 0 runs in the calling thread, each other replica in a thread of its own.

    Returns the outputs in replica order. If replicas raise, the exception of the lowest
    replica is re-raised in the caller: the original exception object (so ``except
    torch.OutOfMemoryError`` still works) with its original traceback from inside the replica,
    and a note naming the replica and its device. All threads are joined before raising.
    """
    n = len(modules)
    kwargs = list(kwargs) if kwargs is not None else [{} for _ in range(n)]
    if not (len(inputs) == len(kwargs) == len(devices) == n):
        raise ConfigError(
            f"parallel_apply: got {n} modules, {len(inputs)} inputs, {len(kwargs)} kwargs and "
            f"{len(devices)} devices",
            fix="pass one input tuple, one kwargs dict and one device per module",
        )
    devs = [torch.device(d) for d in devices]
    enter = _caller_state(devs)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def work(i: int) -> None:
        try:
            with enter(i):
                results[i] = modules[i](*inputs[i], **kwargs[i])
        except BaseException as exc:  # re-raised in the caller below, KeyboardInterrupt included
            errors[i] = exc

    # Replica 0 runs in the calling thread (one thread fewer to start and wake per step);
    # the others each get a thread.
    threads = [
        threading.Thread(target=work, args=(i,), name=f"rankwise-replica-{i}") for i in range(1, n)
    ]
    for t in threads:
        t.start()
    work(0)
    for t in threads:
        t.join()
    failed = [i for i, e in enumerate(errors) if e is not None]
    if failed:
        _reraise(failed, errors, devs)
    return results


def _reraise(
    failed: list[int], errors: list[BaseException | None], devices: list[torch.device]
) -> None:
    first = failed[0]
    exc = errors[first]
    assert exc is not None
    note = f"rankwise.parallel.parallel_apply: raised in replica {first} on device {devices[first]}"
    others = [f"{i} ({devices[i]}: {type(errors[i]).__name__})" for i in failed[1:]]
    if others:
        note += f"; replica(s) {', '.join(others)} failed too"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: no notes, so the tag goes into the message
        exc.args = (f"{exc.args[0] if exc.args else ''}\n{note}", *exc.args[1:])
    # `raise exc` keeps exc.__traceback__ (the replica thread's frames) and appends ours.
    raise exc
