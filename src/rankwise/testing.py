"""``run_distributed(fn, world_size)``: run a function in real processes, as a test would want.

Each rank is a spawned process that joins a gloo (or nccl) group through a store the parent
hosts on a free port (no port clash between concurrent tests), runs ``fn(*args)`` and sends back
its return value or its traceback. The parent fails fast: the first failing rank ends the run,
and a run that passes its timeout is a failure that carries every rank's current stack (taken
with faulthandler), never a stuck test suite.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import DistributedError

_GRACE_S = 3.0
"""How long the other ranks get to report their own error after the first one fails."""


def _child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    backend: str | None,
    port: int,
    timeout: float,
    results: Any,
    stack_file: str,
    env: dict[str, str],
    init: bool,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # The parent hosts the store: every rank connects as a client (torchrun does the same).
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            import rankwise

            if init:
                rankwise.init(backend, timeout=timeout)
            value = fn(*args)
            # Plain pickle sends tensors by value; the queue's own pickler would share them
            # through file descriptors that vanish when this process exits.
            results.put((rank, True, pickle.dumps(value)))
        except BaseException as exc:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            results.put((rank, False, text))
        finally:
            try:
                import rankwise

                rankwise.shutdown()
            except Exception:
                pass
    sys.stdout.flush()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    backend: str | None = "gloo",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    init: bool = True,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return the per-rank results in order.

    ``fn`` must be importable by the children (a module-level function, not a lambda).
    With ``init=True`` each rank calls ``rankwise.init(backend)`` first, so ``fn`` can use
    collectives directly; ``init=False`` leaves that to ``fn`` (to test ``init`` itself).
    ``timeout`` bounds the whole run; it is also the collectives' timeout inside the ranks.
    ``env`` adds environment variables in every rank. Raises ``DistributedError`` naming the
    failed (or hung) ranks with their tracebacks.
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    tmp = tempfile.TemporaryDirectory(prefix="rankwise-test-")
    stack_files = [str(Path(tmp.name) / f"rank{r}.stack") for r in range(world_size)]
    extra = {"OMP_NUM_THREADS": "1", **(env or {})}
    child_args = (fn, args, world_size, backend, store.port, timeout, results, extra, init)
    procs = [_process(ctx, r, child_args, stack_files[r]) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, stack_files, timeout)
    finally:
        for p in procs:
            if p.pid is None:  # never started (spawning an earlier rank failed)
                continue
            if p.is_alive():
                p.kill()
            p.join(5)
        del store
        tmp.cleanup()


def _process(ctx: Any, rank: int, child_args: tuple, stack_file: str) -> Any:
    """Rank ``rank``'s process (not started): ``_child``'s arguments in its order."""
    fn, args, world_size, backend, port, timeout, results, extra, init = child_args
    return ctx.Process(
        target=_child,
        args=(fn, args, rank, world_size, backend, port, timeout, results, stack_file, extra, init),
        name=f"rank{rank}",
        daemon=True,
    )


def _collect(procs, results, stack_files, timeout: float) -> list[Any]:
    world_size = len(procs)
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        if first_failure_at is not None and now > first_failure_at + _GRACE_S:
            break
        if now > deadline:
            return _hang(procs, values, failures, stack_files, timeout)
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            for r, p in enumerate(procs):
                if not p.is_alive() and r not in values and r not in failures:
                    # Give the queue a moment: a rank that finished may still be flushing.
                    p.join(0.5)
                    if r not in values and results.empty():
                        failures[r] = f"process exited with code {p.exitcode} before reporting"
                        first_failure_at = first_failure_at or time.monotonic()
            continue
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            failures[rank] = payload
            first_failure_at = first_failure_at or time.monotonic()
    if failures:
        raise DistributedError(_report("failed", failures, procs, values))
    return [values[r] for r in range(world_size)]


def _hang(procs, values, failures, stack_files, timeout: float):
    signalled = []
    for r, p in enumerate(procs):
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGUSR1)
            signalled.append(Path(stack_files[r]))
    # faulthandler writes from a signal handler: give every rank a moment to finish its dump.
    until = time.monotonic() + 3.0
    while time.monotonic() < until and not all(f.exists() and f.stat().st_size for f in signalled):
        time.sleep(0.05)
    for r in range(len(procs)):
        if r in values or r in failures:
            continue
        stack = Path(stack_files[r]).read_text() if Path(stack_files[r]).exists() else ""
        failures[r] = f"still running after {timeout:.0f}s (hang). Its stack:\n{stack}"
    raise DistributedError(_report("timed out", failures, procs, values))


def _report(what: str, failures: dict[int, str], procs, values) -> str:
    # Dicts keep insertion order: the first rank to fail (usually the cause) comes first.
    ranks = ", ".join(str(r) for r in failures)
    parts = [f"run_distributed {what} on rank(s) {ranks} of {len(procs)} (first failure first)"]
    for r in failures:
        parts.append(f"--- rank {r} ---\n{failures[r].rstrip()}")
    done = [r for r in range(len(procs)) if r in values]
    if done:
        parts.append(f"(rank(s) {', '.join(map(str, done))} finished normally)")
    return "\n".join(parts)
