"""The failure summary: which rank died, how (exit code or signal), and its last traceback lines.

Pure functions over a small record type, so the text can be tested without killing anything.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from ..errors import DistributedError
from .machines import Machines

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
    stderr_tail: str = ""
    """The last lines it wrote to stderr (quoted for a native abort, which leaves no traceback)."""

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
        culprits: dict[int, list[int]] | None = None,
        finished: list[int] | None = None,
        signalled: set[int] | None = None,
        machines: Machines | None = None,
    ) -> None:
        self.failures = failures
        self.world_size = world_size
        self.root = split_stopped(failures, signalled)[0][0]
        self.blamed = blame(failures, diagnoses or {}, culprits or {}, signalled)
        self.finished = sorted(set(finished or ()) - {f.rank for f in failures})
        """Ranks that had ended normally before the failure (their diagnosis said so)."""
        self.machines = machines or Machines()
        """Nodes whose ranks all stopped responding; the store this node could not reach."""
        text = summarize(
            failures, world_size=world_size, node_rank=node_rank, diagnoses=diagnoses,
            blamed=self.blamed, finished=self.finished, signalled=signalled,
        )  # fmt: skip
        failed = [f.rank for f in split_stopped(failures, signalled)[0]]
        machine_line = self.machines.headline(self.blamed, failed, world_size, node_rank)
        if machine_line:  # a node went silent, or the master's machine is out of reach
            text = machine_line + text[text.index("\n") :] if "\n" in text else machine_line
            fix = self.machines.fix(self.blamed, node_rank)
        elif self.finished and not self.blamed:
            fix = (
                f"rank {self.root.rank} called a collective that rank(s) "
                f"{', '.join(map(str, self.finished))} never call (the diagnosis names its "
                "file and line): every rank must call each collective, not only under "
                "`if rank == 0:`."
            )
        elif self.blamed:
            who = ", ".join(str(r) for r in self.blamed)
            fix = (
                f"look at where rank(s) {who} were (the diagnosis names the file and line; "
                f"their output lines start with [rank{self.blamed[0]}]:): the other ranks "
                "waited for them until the timeout."
            )
        else:
            fix = (
                f"see rank {self.root.rank}'s output above (its lines start with "
                f"[rank{self.root.rank}]:); the other ranks were stopped because of it."
            )
        super().__init__(text, fix=fix)

    @property
    def exit_code(self) -> int:
        """The root failure's exit code, or 128 + signal for a killed worker (shell convention)."""
        code = self.root.exitcode
        return 128 - code if code < 0 else (code if 0 < code < 256 else 1)


def split_stopped(
    failures: list[RankFailure], signalled: set[int] | None = None
) -> tuple[list[RankFailure], list[RankFailure]]:
    """(failed, stopped): workers the agent stopped because another failed are not failures.

    ``signalled``: the local ranks still running when the agent closed the group (it sent them
    SIGTERM, then SIGKILL to those that did not end: a frozen rank ends with signal 9, a rank
    that handles SIGTERM with its own exit code). A SIGTERM exit counts as stopped too.
    When every worker counts as stopped (the launcher itself was told to stop), all count as
    failed, so the summary is never empty.
    """
    signalled = signalled or set()
    is_stopped = [f.exitcode == -signal.SIGTERM or f.local_rank in signalled for f in failures]
    stopped = [f for f, s in zip(failures, is_stopped, strict=True) if s]
    failed = [f for f, s in zip(failures, is_stopped, strict=True) if not s]
    return (failed, stopped) if failed else (stopped, [])


def _quoted(failed: list[RankFailure], diagnoses: dict[int, str]) -> int | None:
    """The rank whose diagnosis the summary quotes: the first failing one that has one."""
    order = [f.rank for f in failed if f.rank in diagnoses] + sorted(diagnoses)
    return order[0] if order else None


def blame(
    failures: list[RankFailure],
    diagnoses: dict[int, str],
    culprits: dict[int, list[int]],
    signalled: set[int] | None = None,
) -> list[int]:
    """Ranks the quoted diagnosis blames (a hung or dead rank), when they are not the ones
    that failed: the ranks that timed out were its victims. Empty otherwise."""
    failed, _ = split_stopped(failures, signalled)
    quoted = _quoted(failed, diagnoses)
    named = culprits.get(quoted, []) if quoted is not None else []
    failed_ranks = {f.rank for f in failed}
    return [r for r in named if r not in failed_ranks]


def read_culprits(folder: str | os.PathLike) -> dict[int, list[int]]:
    """The ``rank<r>.json`` blame records that ranks wrote beside their diagnoses, by rank."""
    import json

    found: dict[int, list[int]] = {}
    for path in sorted(Path(folder).glob("rank*.json")) if Path(folder).is_dir() else []:
        digits = path.stem[len("rank") :]
        try:
            ranks = json.loads(path.read_text(encoding="utf-8")).get("culprits", [])
        except (OSError, ValueError, AttributeError):
            continue
        if digits.isdigit() and all(isinstance(r, int) for r in ranks):
            found[int(digits)] = ranks
    return found


def read_finished(folder: str | os.PathLike) -> list[int]:
    """Ranks that a diagnosis found already finished normally (``rank<r>.json``)."""
    import json

    found: set[int] = set()
    for path in sorted(Path(folder).glob("rank*.json")) if Path(folder).is_dir() else []:
        try:
            ranks = json.loads(path.read_text(encoding="utf-8")).get("finished", [])
        except (OSError, ValueError, AttributeError):
            continue
        found.update(r for r in ranks if isinstance(r, int))
    return sorted(found)


def read_diagnoses(folder: str | os.PathLike) -> dict[int, str]:
    """The ``rank<r>.txt`` diagnoses that ranks wrote (``rankwise.diagnose``), by rank."""
    found: dict[int, str] = {}
    for path in sorted(Path(folder).glob("rank*.txt")) if Path(folder).is_dir() else []:
        digits = path.stem[len("rank") :]
        if digits.isdigit():
            found[int(digits)] = path.read_text(encoding="utf-8", errors="replace").strip()
    return found


_SIGNAL_NOTES = {
    signal.SIGKILL: "killed by SIGKILL, so no traceback: the kernel's out-of-memory killer is "
    "a common cause (`dmesg` shows it), or someone killed it",
    signal.SIGABRT: "aborted (SIGABRT) by a failed check in native code (gloo, NCCL or a C++ "
    "extension), so no Python traceback; its own message is the last lines it printed",
    signal.SIGSEGV: "crashed in native code (SIGSEGV), so no Python traceback",
}


def _no_traceback(f: RankFailure) -> list[str]:
    try:
        note = _SIGNAL_NOTES.get(signal.Signals(-f.exitcode), "killed by a signal, so no traceback")
    except ValueError:
        note = "killed by a signal, so no traceback"
    lines = [f"    ({note})"]
    tail = [line for line in f.stderr_tail.rstrip().splitlines() if line.strip()]
    if tail:
        lines.append("    its last lines on stderr:")
        lines.extend(f"      {line}" for line in tail[-TRACEBACK_LINES:])
    return lines


def summarize(
    failures: list[RankFailure],
    *,
    world_size: int,
    node_rank: int,
    diagnoses: dict[int, str] | None = None,
    blamed: list[int] | None = None,
    finished: list[int] | None = None,
    signalled: set[int] | None = None,
) -> str:
    """A few lines per failed rank, the first failure (usually the root cause) first.

    When a rank diagnosed a failed collective, the first diagnosis (by the failing ranks'
    order, then by rank) is quoted once, instead of that rank's traceback tail (which ends with
    the same text). When it blames ranks that did not fail themselves (they hung, the others
    timed out waiting), the headline names those ranks.
    """
    failed, stopped = split_stopped(failures, signalled)
    diagnoses = diagnoses or {}
    quoted = _quoted(failed, diagnoses)
    lines = [_headline(failed, world_size, node_rank, blamed, finished)]
    for f in failed:
        lines.append(f"  rank {f.rank} (local_rank {f.local_rank}, pid {f.pid}): {f.cause}")
        tail = [line for line in f.traceback.rstrip().splitlines() if line.strip()]
        if f.rank == quoted:
            lines.append("    (its diagnosis is below)")
        else:
            lines.extend(f"    {line}" for line in tail[-TRACEBACK_LINES:])
        if not tail and f.exitcode < 0:
            lines.extend(_no_traceback(f))
    if stopped:
        lines.append(
            f"  stopped by the launcher: rank(s) {', '.join(str(f.rank) for f in stopped)}"
        )
    if quoted is not None:
        lines.append("  diagnosis:")
        lines.extend(f"    {line}" for line in diagnoses[quoted].splitlines())
    return "\n".join(lines)


def _headline(
    failed: list[RankFailure],
    world_size: int,
    node_rank: int,
    blamed: list[int] | None,
    finished: list[int] | None,
) -> str:
    ranks = ", ".join(str(f.rank) for f in failed)
    where = (
        f"(world size {world_size}, node {node_rank}); every other worker of this node was stopped"
    )
    if finished:  # they were not stopped: they had ended, exit code 0
        done = ", ".join(str(r) for r in finished)
        where = (
            f"in a collective that rank(s) {done} never called: those had already finished "
            f"normally (world size {world_size}, node {node_rank})"
        )
    if blamed:
        return (
            f"rank(s) {', '.join(str(r) for r in blamed)} never reached the collective that "
            f"rank(s) {ranks} waited in until they failed {where}"
        )
    return f"rank(s) {ranks} failed {where}"


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
