"""Run a Python function in N fresh processes that form a job: the one child bootstrap shared by
``rankwise.testing.run_distributed`` (tests) and ``rw.launch`` (notebooks, plain functions).

Each rank is a child process given the environment ``rankwise run`` gives its workers (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, and a store hosted by the parent on a free port, so
concurrent jobs never clash). It runs ``fn(*args)`` and sends back its return value or its
error. The parent fails fast: the first failing rank ends the run, and a run that passes its
timeout is a failure carrying every rank's current stack (taken with faulthandler).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import env as envmod
from ..console import redraws_in_place
from .bootstrap import die_with_parent
from .output import RankLines

_GRACE_S = 3.0
"""How long the other ranks get to report their own error after the first one fails."""


@dataclass(frozen=True)
class Failure:
    """How one rank failed: its traceback text and, when it could be pickled, the exception."""

    text: str
    exception: BaseException | None = None


class _QueueWriter:
    """A child's stdout/stderr: whole lines go to the parent, which prints them with the rank."""

    def __init__(self, results: Any, rank: int, stream: str) -> None:
        self.results, self.rank, self.stream = results, rank, stream
        self.encoding = getattr(getattr(sys, stream), "encoding", None)  # tqdm: unicode blocks
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self.results.put(("out", self.rank, self.stream, line))
        if "\r" in self._pending:  # a bar redrawn in place: its newest state, as it stands
            text_now = self._pending.rsplit("\r", 1)[1].rstrip()
            self.results.put(("bar", self.rank, self.stream, text_now))
            self._pending = ""
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.results.put(("out", self.rank, self.stream, self._pending))
            self._pending = ""

    def isatty(self) -> bool:
        return False


def _pickled_exception(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # an exception whose __init__ needs other arguments fails here
        return data
    except Exception:
        return None


def _set_rank_env(env: dict[str, str], rank: int, world_size: int, port: int) -> None:
    """The variables a launcher gives a worker (this child is one), read by ``rw.init``."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # The parent hosts the store: every rank connects as a client (torchrun does the same).
        TORCHELASTIC_USE_AGENT_STORE="True",
    )


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
    stream: bool = False,
    parent: int | None = None,
) -> None:
    # A notebook kernel killed or restarted must not leave ranks training (as `rankwise run`).
    die_with_parent(parent)
    _set_rank_env(env, rank, world_size, port)
    if stream:
        sys.stdout = _QueueWriter(results, rank, "stdout")  # type: ignore[assignment]
        sys.stderr = _QueueWriter(results, rank, "stderr")  # type: ignore[assignment]
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            if init:
                from ..session import init as rw_init  # rw.init: the Session the user gets

                rw_init(backend, timeout=timeout)
            value = fn(*args)
            sys.stdout.flush()
            sys.stderr.flush()
            # Plain pickle sends tensors by value; the queue's own pickler would share them
            # through file descriptors that vanish when this process exits.
            results.put(("result", rank, True, pickle.dumps(value)))
        except SystemExit as exc:
            results.put(_exited(rank, exc))
        except BaseException as exc:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            sys.stdout.flush()
            sys.stderr.flush()
            results.put(("result", rank, False, (text, _pickled_exception(exc))))
        finally:
            try:
                from ..runtime import shutdown

                shutdown()
            except Exception:
                pass
    sys.stdout.flush()


def _exited(rank: int, exc: SystemExit) -> tuple:
    """``sys.exit()``/``sys.exit(0)`` is a normal end (nothing returned); another code fails."""
    if exc.code in (None, 0):
        return ("result", rank, True, pickle.dumps(None))
    return ("result", rank, False, (f"SystemExit: sys.exit({exc.code!r}) in rank {rank}\n", None))


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
    ctx = mp.get_context(start_method)
    me = os.getpid()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    tmp = tempfile.TemporaryDirectory(prefix="rankwise-ranks-")
    stack_files = [str(Path(tmp.name) / f"rank{r}.stack") for r in range(world_size)]
    shown = RankLines(live=stream and redraws_in_place(sys.stdout))
    extra = {"OMP_NUM_THREADS": "1", **envmod.live_bars_env(shown.live), **(env or {})}
    common = (backend, store.port, timeout or 1800.0, results)
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, args, r, world_size, *common, stack_files[r], extra, init, stream, me),
            name=f"rank{r}",
            # Not daemonic: a rank may start processes of its own (DataLoader workers), which
            # multiprocessing refuses to daemons. _end() still kills every rank left, and each
            # dies with its parent (die_with_parent).
            daemon=False,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, stack_files, timeout, shown)
    finally:
        shown.end()
        _end(procs)
        del store
        tmp.cleanup()


def _end(procs: list) -> None:
    """Kill what still runs; sweep the shared-memory files a SIGKILLed rank 0 left."""
    for p in procs:
        if p.pid is None:  # never started (spawning an earlier rank failed)
            continue
        if p.is_alive():
            p.kill()
        p.join(5)
    from ..parallel.ddp import shm_file

    shm_file.sweep_stale()


def _collect(procs, results, stack_files, timeout: float | None, shown: RankLines):
    world_size = len(procs)
    values: dict[int, Any] = {}
    failures: dict[int, Failure] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure_at: float | None = None
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        if first_failure_at is not None and now > first_failure_at + _GRACE_S:
            break
        if deadline is not None and now > deadline:
            _hang(procs, values, failures, stack_files, timeout)
            return values, failures, True
        try:
            message = results.get(timeout=0.2)
        except queue.Empty:
            for r, p in enumerate(procs):
                if not p.is_alive() and r not in values and r not in failures:
                    # Give the queue a moment: a rank that finished may still be flushing.
                    p.join(0.5)
                    if r not in values and results.empty():
                        why = f"process {exit_text(p.exitcode)} before reporting"
                        failures[r] = Failure(why)
                        first_failure_at = first_failure_at or time.monotonic()
            continue
        if message[0] == "out":
            shown.line(*message[1:])
            continue
        if message[0] == "bar":
            shown.bar_update(*message[1:])
            continue
        _, rank, ok, payload = message
        if ok:
            values[rank] = pickle.loads(payload)
        else:
            text, exc = payload
            failures[rank] = Failure(text, None if exc is None else pickle.loads(exc))
            first_failure_at = first_failure_at or time.monotonic()
    return values, failures, False


def exit_text(code: int | None) -> str:
    """How a process ended, in words: ``was killed by signal 11 (SIGSEGV)``, not ``-11``."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _hang(procs, values, failures, stack_files, timeout: float) -> None:
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
        failures[r] = Failure(f"still running after {timeout:.0f}s (hang). Its stack:\n{stack}")


def report(
    who: str, what: str, failures: dict[int, Failure], values: dict[int, Any], world_size: int
) -> str:
    """Every failed rank's traceback, the first failure (usually the cause) first."""
    ranks = ", ".join(str(r) for r in failures)
    parts = [f"{who} {what} on rank(s) {ranks} of {world_size} (first failure first)"]
    for r, failure in failures.items():
        parts.append(f"--- rank {r} ---\n{failure.text.rstrip()}")
    if values:
        parts.append(f"(rank(s) {', '.join(map(str, sorted(values)))} finished normally)")
    return "\n".join(parts)
