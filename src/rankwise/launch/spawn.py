"""Run a Python function in N fresh processes that form a job: the one child bootstrap shared by
``rankwise.testing.run_distributed`` (tests) and ``rw.launch`` (notebooks, plain functions).

Each rank is a child process given the environment ``rankwise run`` gives its workers (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, and a store hosted by the parent on a free port, so
concurrent jobs never clash). It runs ``fn(*args)`` and sends back its return value or its
error. The parent fails fast: the first failing rank ends the run, and a run that passes its
timeout is a failure carrying every rank's current stack (taken with faulthandler).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from ..errors import DistributedError
from ..job import env as envmod
from ..output.console import printable, redraws_in_place
from .child import _QueueWriter, child
from .output import RankLines

__all__ = ["Failure", "_QueueWriter", "causes_first", "exit_text", "report", "spawn_ranks"]

_EXIT_S = 5.0
"""How long the ranks that reported their result get, together, to end on their own."""

_GRACE_S = 10.0
"""How long the other ranks get to report their own error after the first one fails (their
diagnosis names the rank that raised; under load, making it takes a few seconds). The run
ends as soon as every rank has reported."""


@dataclass(frozen=True)
class Failure:
    """How one rank failed: its traceback text and, when it could be pickled, the exception."""

    text: str
    exception: BaseException | None = None


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    backend: str | None = "gloo",
    timeout: float | None = 120.0,
    env: dict[str, str] | None = None,
    init: bool = True,
    stream: bool = False,
    start_method: str = "spawn",
) -> tuple[dict[int, Any], dict[int, Failure], bool]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return (values by rank, failures by rank in
    the order they failed, whether the run timed out). ``stream``: the children's output is
    printed here, each line prefixed with ``[rank r]``. ``timeout=None``: no deadline."""
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    ctx, forked = _context(start_method)
    # A forked rank's parent is the server, which ends with this process.
    parent = None if forked else os.getpid()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    tmp = tempfile.TemporaryDirectory(prefix="rankwise-ranks-")
    stack_files = [str(Path(tmp.name) / f"rank{r}.stack") for r in range(world_size)]
    shown = RankLines(live=stream and redraws_in_place(sys.stdout))
    extra = {"OMP_NUM_THREADS": "1", **envmod.live_bars_env(shown.live), **(env or {})}
    if forked:  # a fork of the server has the server's environment: send this one, whole
        extra = {**os.environ, **extra}
    how = {"forked": _Stdio() if forked else None}
    common = (backend, store.port, timeout or 1800.0)
    ranks: list[_Rank] = []
    values: dict[int, Any] = {}
    failures: dict[int, Failure] = {}
    try:
        for r in range(world_size):
            ranks.append(_start(ctx, r, how, lambda w, r=r: (
                fn, args, r, world_size, *common, w, stack_files[r], extra, init, stream, parent
            )))  # fmt: skip
        values, failures, timed_out = _collect(ranks, stack_files, timeout, shown)
        return values, failures, timed_out
    finally:
        shown.end()
        # After a failure the others are ended at once: one may be blocked on the failed rank.
        finishing = [] if failures else [ranks[r].proc for r in values]
        _end([rk.proc for rk in ranks], finishing)
        del store
        tmp.cleanup()


def _start(ctx: Any, r: int, how: dict, child_args: Callable[[Any], tuple]) -> _Rank:
    """Start rank ``r``'s process (``child_args(pipe end)``: ``child``'s arguments). Not
    daemonic: a rank may start processes of its own (DataLoader workers), which multiprocessing
    refuses to daemons; ``_end()`` still kills every rank left, and each dies with its parent
    (``die_with_parent``)."""
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child, args=child_args(writer), kwargs=how, name=f"rank{r}",
                       daemon=False)  # fmt: skip
    proc.start()
    writer.close()  # the child holds its own copy: the pipe closes when it ends
    return _Rank(proc, reader)


def _context(start_method: str) -> tuple[Any, bool]:
    """The multiprocessing context, and whether its ranks are forks of the forkserver (which
    imports torch once: a rank then starts in hundredths of a second, not seconds)."""
    ctx = mp.get_context(start_method)
    forked = start_method == "forkserver"
    if forked:
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx, forked


class _Stdio:
    """This process's stdout and stderr as they are now (a test's capture, say), for a rank
    forked by the server, whose own are the server's: pickled, each is a descriptor the rank
    receives (as a ``Pipe`` end is)."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        sys.stdout.flush()
        sys.stderr.flush()
        return (_adopt, (DupFd(1), DupFd(2)))


def _adopt(out: Any, err: Any) -> tuple[int, int]:
    return out.detach(), err.detach()


@dataclass
class _Rank:
    """The parent's view of one child: its process, its pipe, and the phase it last reported."""

    proc: Any
    reader: Any
    phase: str = "starting its process (spawn, imports)"
    since: float = field(default_factory=time.monotonic)
    open: bool = True


def _end(procs: list, finishing: list = ()) -> None:
    """Kill what still runs; sweep the shared-memory files a SIGKILLed rank 0 left. A rank
    that reported its result (``finishing``) gets up to ``_EXIT_S`` to end on its own first:
    killed on the way out, it would skip its exit handlers (``atexit``, multiprocessing's
    finalizers), which flush what it wrote."""
    until = time.monotonic() + _EXIT_S
    for p in finishing:
        p.join(max(0.0, until - time.monotonic()))
    for p in procs:
        if p.pid is None:  # never started (spawning an earlier rank failed)
            continue
        if p.is_alive():
            p.kill()
        p.join(5)
    from ..parallel.ddp.node import shm_file

    shm_file.sweep_stale()


def _collect(ranks: list[_Rank], stack_files, timeout: float | None, shown: RankLines):
    values: dict[int, Any] = {}
    failures: dict[int, Failure] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure_at: float | None = None
    while len(values) + len(failures) < len(ranks):
        now = time.monotonic()
        if first_failure_at is not None and now > first_failure_at + _GRACE_S:
            break
        if deadline is not None and now > deadline:
            _hang(ranks, values, failures, stack_files, timeout)
            return values, failures, True
        readers = {rk.reader: r for r, rk in enumerate(ranks) if rk.open}
        for reader in wait(list(readers), timeout=0.2):
            _receive(readers[reader], ranks[readers[reader]], values, failures, shown)
        for r, rk in enumerate(ranks):  # ended without a result (its pipe drained, or closed)
            if r in values or r in failures or (rk.proc.is_alive() and rk.open):
                continue
            if rk.open and rk.reader.poll():
                continue  # messages left to read
            rk.proc.join(5)
            why = f"process {exit_text(rk.proc.exitcode)} before reporting, while {rk.phase}"
            failures[r] = Failure(why)
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
    return values, failures, False


def _receive(r: int, rk: _Rank, values: dict, failures: dict, shown: RankLines) -> None:
    """Read one message of rank ``r``: a line, a bar, its phase, or its result."""
    try:
        message = rk.reader.recv()
    except (EOFError, OSError):  # the process ended and its pipe is drained
        rk.open = False
        return
    kind = message[0]
    if kind == "out":
        shown.line(*message[1:])
    elif kind == "bar":
        shown.bar_update(*message[1:])
    elif kind == "phase":
        rk.phase, rk.since = message[2], time.monotonic()
    elif message[2]:
        values[r] = pickle.loads(message[3])  # our own child, same user (no peer's data)
    else:
        text, exc = message[3]
        failures[r] = Failure(text, None if exc is None else pickle.loads(exc))


def exit_text(code: int | None) -> str:
    """How a process ended, in words: ``was killed by signal 11 (SIGSEGV)``, not ``-11``."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _await_dumps(files: list[Path], limit_s: float = 5.0, settle_s: float = 0.3) -> None:
    """Wait until each rank's faulthandler dump is whole: it writes from a signal handler, a
    piece of a line at a time, and a file read as soon as it was not empty once ended in the
    middle of a frame's line (under load: ``File`` and nothing after). Whole: not empty and
    unchanged for ``settle_s``; at most ``limit_s`` in all."""
    until = time.monotonic() + limit_s
    sizes: list[int] = []
    steady_since = time.monotonic()
    while time.monotonic() < until:
        now = [f.stat().st_size if f.exists() else 0 for f in files]
        if now != sizes:
            sizes, steady_since = now, time.monotonic()
        elif all(now) and time.monotonic() - steady_since >= settle_s:
            return
        time.sleep(0.05)


def _hang(ranks: list[_Rank], values, failures, stack_files, timeout: float) -> None:
    signalled = []
    for r, rk in enumerate(ranks):
        if rk.proc.is_alive() and rk.proc.pid is not None:
            os.kill(rk.proc.pid, signal.SIGUSR1)
            signalled.append(Path(stack_files[r]))
    _await_dumps(signalled)
    now = time.monotonic()
    for r, rk in enumerate(ranks):
        if r in values or r in failures:
            continue
        stack = Path(stack_files[r]).read_text() if Path(stack_files[r]).exists() else ""
        failures[r] = Failure(
            f"still running after {timeout:.0f}s (hang): rank {r} was {rk.phase} (for "
            f"{now - rk.since:.0f}s). Its stack:\n{stack}"
        )


def _consequence(f: Failure) -> bool:
    """The rank failed only waiting for another: rankwise's diagnosis of a collective."""
    if f.exception is not None:
        return isinstance(f.exception, DistributedError)
    return "DistributedError: " in f.text


def _exception_line(f: Failure) -> str:
    if f.exception is not None:
        lines = str(f.exception).strip().splitlines()
        return printable(f"{type(f.exception).__name__}: {lines[0]}" if lines else
                         type(f.exception).__name__, 300)  # fmt: skip
    lines = [ln for ln in f.text.strip().splitlines() if ln.strip()]
    return printable(lines[-1], 300) if lines else "an error"


def causes_first(failures: dict[int, Failure]) -> dict[int, Failure]:
    """The failures with the ranks that raised their own exception first (the cause), then
    the ranks that failed waiting for them, each group in the order they failed."""
    first = {r: f for r, f in failures.items() if not _consequence(f)}
    return {**first, **{r: f for r, f in failures.items() if r not in first}}


def report(
    who: str, what: str, failures: dict[int, Failure], values: dict[int, Any], world_size: int
) -> str:
    """Every failed rank's traceback, the rank that raised (the cause) first, named with its
    exception in the first line."""
    failures = causes_first(failures)
    ranks = ", ".join(str(r) for r in failures)
    head = f"{who} {what} on rank(s) {ranks} of {world_size}"
    raisers = [r for r, f in failures.items() if not _consequence(f)]
    if raisers and what == "failed":
        waited = [r for r in failures if r not in raisers]
        head += f": rank {raisers[0]} raised {_exception_line(failures[raisers[0]])}"
        if waited:
            head += f"; rank(s) {', '.join(map(str, waited))} failed waiting for it"
    parts = [f"{head} (the cause first)"]
    for r, failure in failures.items():
        parts.append(f"--- rank {r} ---\n{failure.text.rstrip()}")
    if values:
        parts.append(f"(rank(s) {', '.join(map(str, sorted(values)))} finished normally)")
    return "\n".join(parts)
