"""The failure summary: which rank died, how (exit code or signal), and its last traceback lines.

Pure functions over a small record type, so the text can be tested without killing anything.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from ..errors import DistributedError

TRACEBACK_LINES = 8
"""How many of the last traceback lines of each failed rank the summary shows."""


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """How one worker ended."""

    rank: int
    """Global rank of the worker."""
    local_rank: int
    """Its index on this node."""
    pid: int
    """Its process id."""
    exitcode: int
    """Its exit code; negative -N when signal N killed it (Python's convention)."""
    traceback: str = ""
    """The traceback it recorded (empty when it was killed or exited without an exception)."""

    @property
    def cause(self) -> str:
        """'exit code 1' or 'signal 9 (SIGKILL)'."""
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = "unknown signal"
            return f"signal {-self.exitcode} ({name})"
        return f"exit code {self.exitcode}"


class JobFailed(DistributedError):
    """One or more workers failed; every other worker of this node was stopped."""

    def __init__(
        self,
        failures: list[RankFailure],
        *,
        world_size: int,
        node_rank: int,
        diagnoses: dict[int, str] | None = None,
    ) -> None:
        self.failures = failures
        self.world_size = world_size
        self.root = split_stopped(failures)[0][0]
        super().__init__(
            summarize(failures, world_size=world_size, node_rank=node_rank, diagnoses=diagnoses),
            fix=f"see rank {self.root.rank}'s output above (its lines start with "
            f"[rank{self.root.rank}]:); the other ranks were stopped because of it.",
        )

    @property
    def exit_code(self) -> int:
        """The root failure's exit code, or 128 + signal for a killed worker (shell convention)."""
        code = self.root.exitcode
        return 128 - code if code < 0 else (code if 0 < code < 256 else 1)


def split_stopped(failures: list[RankFailure]) -> tuple[list[RankFailure], list[RankFailure]]:
    """(failed, stopped): workers that ended with SIGTERM were stopped by the agent, not failing.

    When every worker ended with SIGTERM (the launcher itself was told to stop), all count as
    failed, so the summary is never empty.
    """
    stopped = [f for f in failures if f.exitcode == -signal.SIGTERM]
    failed = [f for f in failures if f.exitcode != -signal.SIGTERM]
    return (failed, stopped) if failed else (stopped, [])


def read_diagnoses(folder: str | os.PathLike) -> dict[int, str]:
    """The ``rank<r>.txt`` diagnoses that ranks wrote (``rankwise.diagnose``), by rank."""
    found: dict[int, str] = {}
    for path in sorted(Path(folder).glob("rank*.txt")) if Path(folder).is_dir() else []:
        digits = path.stem[len("rank") :]
        if digits.isdigit():
            found[int(digits)] = path.read_text(encoding="utf-8", errors="replace").strip()
    return found


def summarize(
    failures: list[RankFailure],
    *,
    world_size: int,
    node_rank: int,
    diagnoses: dict[int, str] | None = None,
) -> str:
    """A few lines per failed rank, the first failure (usually the root cause) first.

    When a rank diagnosed a failed collective, the first diagnosis (by the failing ranks'
    order, then by rank) is quoted: it says which rank waited where, and why.
    """
    failed, stopped = split_stopped(failures)
    ranks = ", ".join(str(f.rank) for f in failed)
    lines = [
        f"rank(s) {ranks} failed (world size {world_size}, node {node_rank}); "
        "every other worker of this node was stopped"
    ]
    for f in failed:
        lines.append(f"  rank {f.rank} (local_rank {f.local_rank}, pid {f.pid}): {f.cause}")
        tail = [line for line in f.traceback.rstrip().splitlines() if line.strip()]
        lines.extend(f"    {line}" for line in tail[-TRACEBACK_LINES:])
        if not tail and f.exitcode < 0:
            lines.append(
                "    (killed by a signal, so no traceback; running out of memory is a common cause)"
            )
    if stopped:
        lines.append(
            f"  stopped by the launcher: rank(s) {', '.join(str(f.rank) for f in stopped)}"
        )
    if diagnoses:
        order = [f.rank for f in failed if f.rank in diagnoses] + sorted(diagnoses)
        lines.append("  diagnosis:")
        lines.extend(f"    {line}" for line in diagnoses[order[0]].splitlines())
    return "\n".join(lines)


def from_elastic(failures: dict) -> list[RankFailure]:
    """Convert torch.distributed.elastic's ``{rank: ProcessFailure}``, earliest failure first."""
    out = []
    for rank, pf in sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0])):
        message = pf.message
        if isinstance(message, dict):
            message = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
        if not isinstance(message, str) or pf.error_file == "<N/A>":
            message = ""
        # torch puts a docs link or "Signal N received" in the message when there is no traceback.
        if message.startswith(("To enable traceback", "Signal ")):
            message = ""
        out.append(
            RankFailure(
                rank=int(rank),
                local_rank=pf.local_rank,
                pid=pf.pid,
                exitcode=pf.exitcode,
                traceback=message,
            )
        )
    return out
