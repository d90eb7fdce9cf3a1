"""One rank of ``spawn_ranks``: the child process's side.

It joins the job through the environment ``rankwise run`` gives its workers, runs ``fn(*args)``
and tells the parent, over its own pipe, what it is doing (its phase), its output lines (when
streamed) and its result or error. A pipe, not a ``multiprocessing.Queue``: a queue hands each
message to a feeder thread that the child starts on its first ``put``, and under heavy load
(load average 12 on 2 cores) that thread took 60 s to start, so a rank that had finished read as
a hang. A pipe write is done by the caller itself, at once, and the parent sees the pipe close
when the process ends.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from .bootstrap import die_with_parent, shown_traceback


class Link:
    """The child's end of its pipe: ``put(message)`` sends one message, whole, from any thread."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def put(self, message: tuple) -> None:
        with self._lock:
            self._conn.send(message)


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


def pickled_exception(exc: BaseException) -> bytes | None:
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


def child(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    backend: str | None,
    port: int,
    timeout: float,
    conn: Any,
    stack_file: str,
    env: dict[str, str],
    init: bool,
    stream: bool = False,
    parent: int | None = None,
    *,
    forked: tuple[int, int] | None = None,
) -> None:
    """The target of each rank's process (``spawn_ranks``). ``forked``: this rank is a fork of
    the forkserver, whose stdout, stderr and environment it has; these are the caller's stdout
    and stderr descriptors, and ``env`` is the caller's whole environment."""
    # A notebook kernel killed or restarted must not leave ranks training (as `rankwise run`).
    die_with_parent(parent)
    if forked is not None:
        _take_stdio(forked)
        os.environ.clear()
    link = Link(conn)
    link.put(("phase", rank, "starting"))
    _set_rank_env(env, rank, world_size, port)
    if forked is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        # torch came with the fork, its thread count read from the server's environment
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    if stream:
        sys.stdout = _QueueWriter(link, rank, "stdout")  # type: ignore[assignment]
        sys.stderr = _QueueWriter(link, rank, "stderr")  # type: ignore[assignment]
    with open(stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        try:
            link.put(_run(fn, args, rank, backend, timeout, init, link))
        finally:
            link.put(("phase", rank, "leaving the job (rw.shutdown)"))
            try:
                from ..runtime import shutdown

                shutdown()
            except Exception:
                pass
    sys.stdout.flush()


def _take_stdio(stdio: tuple[int, int]) -> None:
    """Write to the caller's stdout and stderr (``stdio``'s descriptors), not the server's."""
    for fd, target in zip(stdio, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)


def _run(fn, args, rank: int, backend, timeout: float, init: bool, link: Link) -> tuple:
    """``fn(*args)`` (after ``rw.init`` when ``init``), as the result message to send."""
    try:
        if init:
            from ..session import init as rw_init  # rw.init: the Session the user gets

            link.put(("phase", rank, "joining the job (rw.init)"))
            rw_init(backend, timeout=timeout)
        link.put(("phase", rank, "running the function"))
        value = fn(*args)
        sys.stdout.flush()
        sys.stderr.flush()
        link.put(("phase", rank, "sending its result"))
        # Plain pickle sends tensors by value (the pipe's own pickler would do the same).
        return ("result", rank, True, pickle.dumps(value))
    except SystemExit as exc:
        _tell_peers(exc)
        return _exited(rank, exc)
    except BaseException as exc:
        _tell_peers(exc)  # before leaving the group: the others read why, not "finished"
        text = shown_traceback(exc, (__file__,))
        sys.stdout.flush()
        sys.stderr.flush()
        return ("result", rank, False, (text, pickled_exception(exc)))


def _tell_peers(exc: BaseException) -> None:
    """This rank ends on ``exc`` (a ``sys.exit(0)`` is a normal end): the other ranks' diagnosis
    says "rank r raised ..." (``announce_raised``), and the ``shutdown`` that follows does not
    announce a normal finish over it."""
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
        return
    from ..diagnose.fingerprints.watch import announce_raised

    announce_raised(exc)


def _exited(rank: int, exc: SystemExit) -> tuple:
    """``sys.exit()``/``sys.exit(0)`` is a normal end (nothing returned); another code fails."""
    if exc.code in (None, 0):
        return ("result", rank, True, pickle.dumps(None))
    return ("result", rank, False, (f"SystemExit: sys.exit({exc.code!r}) in rank {rank}\n", None))
