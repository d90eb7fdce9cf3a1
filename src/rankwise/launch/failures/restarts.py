"""Restarts are never silent: one line per failure and per restart, and a summary at the end.

torch's elastic agent restarts the worker group by itself (``--max-restarts``) and says so only
in its own INFO log, without the rank or the cause. It offers no hook for this, so the launcher
runs a subclass of the agent that reports what ``_monitor_workers`` found before the agent acts
on it: the agent's behaviour is unchanged.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..rendezvous.guard import guard
from .report import RankFailure, from_elastic, split_stopped

_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def _why(f: RankFailure) -> str:
    """'exit code 1 (ValueError: ...)': the cause and the exception line of the traceback."""
    found = [s for s in (ln.strip() for ln in f.traceback.splitlines()) if _EXCEPTION_LINE.match(s)]
    return f"{f.cause} ({found[-1][:300]})" if found else f.cause


def _state(pid: int) -> str:
    """The process state letter from ``/proc/<pid>/stat`` ('R', 'S', 'T' stopped ...); '' if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def resume_stopped(pids: list[int]) -> list[int]:
    """SIGCONT the workers that are stopped (SIGSTOP, Ctrl-Z: state 'T'); the ones resumed.

    The agent stops a worker group with SIGTERM and waits 30 s before SIGKILL; a stopped
    process only receives the SIGTERM once it continues, so without this a frozen rank held the
    job's end for those 30 s. Resumed, it gets the SIGTERM that follows at once (and a handler
    it installed runs). A process stopped by a debugger ('t') is left to the agent's SIGKILL.
    """
    resumed = []
    for pid in pids:
        if _state(pid) == "T":
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
                resumed.append(pid)
    return resumed


@dataclass
class RestartLog:
    """What happened to the worker group; ``emit`` prints one line (stderr by default)."""

    max_restarts: int
    emit: Callable[[str], None] = field(
        default=lambda line: print(f"rankwise run: {line}", file=sys.stderr, flush=True)
    )
    restarts: int = 0
    failures: list[str] = field(default_factory=list)
    signalled: set[int] = field(default_factory=set)
    """Local ranks the agent itself stopped (still running when it closed the group): they did
    not fail, the launcher ended them because another did."""
    node_rank: int | None = None
    """This node's rank in the latest rendezvous round (c10d assigns it; static: --node-rank)."""
    world_size: int | None = None
    """The job's world size in the latest round (an elastic job may run with fewer nodes)."""
    _pending: bool = False

    def watch(self, pcontext: object) -> None:
        """Note which workers are still running each time the agent closes ``pcontext``."""
        self.signalled = set()
        close = getattr(pcontext, "close", None)
        handlers = getattr(pcontext, "subprocess_handlers", None)
        if close is None or handlers is None:
            return

        def closing(*args, **kwargs):
            running = {lr for lr, h in handlers.items() if h.proc.poll() is None}
            self.signalled |= running
            resume_stopped([handlers[lr].proc.pid for lr in running])
            return close(*args, **kwargs)

        pcontext.close = closing  # type: ignore[attr-defined]

    def failed(self, failures: list[RankFailure], remaining: int) -> None:
        if not self.max_restarts:
            return  # no restart to announce: the failure summary says it all
        attempt = self.max_restarts - remaining + 1
        failed, stopped = split_stopped(failures, self.signalled)
        for f in failed:
            text = f"rank {f.rank} failed: {_why(f)}"
            self.failures.append(text)
            self.emit(f"{text} (attempt {attempt} of {self.max_restarts + 1})")
        if stopped:
            ranks = ", ".join(str(f.rank) for f in stopped)
            self.emit(f"stopped by the launcher: rank(s) {ranks}")
        self._pending = remaining > 0
        if not self._pending and self.max_restarts:
            self.emit(f"no restart left (all {self.max_restarts} used): the job fails")

    def restarting(self) -> None:
        if not self._pending:
            return  # a restart for a node joining is membership, not recovery
        self._pending = False
        self.restarts += 1
        self.emit(f"restarting all workers (restart {self.restarts} of {self.max_restarts})")

    def summary(self) -> str | None:
        if not self.restarts:
            return None
        return (
            f"the job recovered after {self.restarts} restart(s) "
            f"(of --max-restarts={self.max_restarts}); failures: " + "; ".join(self.failures)
        )


def _agent_class(base: type, log: RestartLog, rdzv_timeout: float) -> type:
    class ReportingAgent(base):
        def __init__(self, spec, *args, **kwargs):
            # launch_agent closes the rendezvous through the same spec: guarded there too.
            spec.rdzv_handler = guard(spec.rdzv_handler, rdzv_timeout)
            super().__init__(spec, *args, **kwargs)

        def _start_workers(self, worker_group):
            started = super()._start_workers(worker_group)
            log.watch(getattr(self, "_pcontext", None))
            log.node_rank = worker_group.group_rank
            workers = worker_group.workers
            log.world_size = workers[0].world_size if workers else None
            return started

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                log.failed(from_elastic(result.failures), self._remaining_restarts)
            return result

        def _restart_workers(self, worker_group) -> None:
            log.restarting()
            super()._restart_workers(worker_group)

    return ReportingAgent


@contextlib.contextmanager
def reporting_restarts(log: RestartLog, rdzv_timeout: float = 300) -> Iterator[RestartLog]:
    """While inside, ``elastic_launch`` runs an agent that reports to ``log`` (and whose c10d
    rendezvous calls give up when the store stops answering: ``rdzv_guard``)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    api.LocalElasticAgent = _agent_class(original, log, rdzv_timeout)
    try:
        yield log
    finally:
        api.LocalElasticAgent = original
