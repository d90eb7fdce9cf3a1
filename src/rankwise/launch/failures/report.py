"""The failure summary: which rank died, how (exit code or signal), and its last traceback lines.

Pure functions over a small record type, so the text can be tested without killing anything.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ...errors import DistributedError
from ...output.console import printable
from .diagnoses import read_causes, read_culprits, read_diagnoses, read_finished, read_raised
from .machines import Machines

__all__ = [
    "JobFailed", "RankFailure", "blame", "from_elastic", "raisers", "read_causes",
    "read_culprits", "read_diagnoses", "read_finished", "read_raised", "split_stopped",
    "summarize",
]  # fmt: skip

TRACEBACK_LINES = 8
"""How many of the last traceback lines of each failed rank the summary shows, when it has
more than ``WHOLE_TRACEBACK`` (a shorter one is shown whole: its first frame is the user's)."""
WHOLE_TRACEBACK = 16


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
    exception: str = ""
    """The exception that ended it, 'ValueError: bad batch' (first line, escaped), when it
    raised one (``rankwise run``'s bootstrap records it); empty otherwise."""

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
        raised: dict[int, str] | None = None,
        causes: dict[int, tuple[str, list[int]]] | None = None,
        stalled: dict[int, str] | None = None,
    ) -> None:
        self.failures = failures
        self.world_size = world_size
        self.root = split_stopped(failures, signalled)[0][0]
        diagnoses = diagnoses or {}
        self.raisers = raisers(failures, diagnoses, raised or {}, signalled)
        """(rank, 'ValueError: ...') of the ranks whose own exception ended the job, first
        first: the cause, named in the headline before anyone who failed waiting for them."""
        blamed = blame(failures, diagnoses, culprits or {}, signalled)
        quoted = _quoted(split_stopped(failures, signalled)[0], diagnoses)
        self.cause = (causes or {}).get(quoted) if quoted is not None else None
        """The quoted diagnosis' cause: ('uneven', [ranks that left the loop]), ('batch', ...)."""
        self.blamed = [] if self.raisers or self._specific() else blamed
        head, stuck = _stalled(split_stopped(failures, signalled)[0], stalled or {}, culprits)
        self.stalled = None if self.raisers else head
        """A rank that a stall report named missing and that ended on it: its own headline."""
        self.blamed = stuck if self.stalled else self.blamed
        self.finished = sorted(set(finished or ()) - {f.rank for f in failures})
        """Ranks that had ended normally before the failure (their diagnosis said so)."""
        self.machines = machines or Machines()
        """Nodes whose ranks all stopped responding; the store this node could not reach."""
        text, diagnosis_fix = summarize(
            failures, world_size=world_size, node_rank=node_rank, diagnoses=diagnoses,
            blamed=self.blamed, finished=self.finished, signalled=signalled,
            raisers=self.raisers, cause=self.cause,
        )  # fmt: skip
        failed = [f.rank for f in split_stopped(failures, signalled)[0]]
        lost = self.machines.headline(self.blamed, failed, world_size, node_rank)
        machine_line = None if self.raisers else lost  # a node went silent, or the store did
        fix = self.machines.fix(self.blamed, node_rank) if machine_line else None
        if not machine_line and self.stalled:
            machine_line = f"{self.stalled} (world size {world_size}, node {node_rank})"
        if machine_line:
            text = machine_line + text[text.index("\n") :] if "\n" in text else machine_line
        super().__init__(text, fix=fix or self._fix(diagnosis_fix))

    def _fix(self, diagnosis_fix: str | None) -> str:
        """One fix: for the rank that raised, else the diagnosis', else by who failed how."""
        if self.raisers:
            rank = self.raisers[0][0]
            return (
                f"rank {rank}'s exception is the cause: read its traceback (above) and fix "
                f"that error. The other ranks failed or were "
                f"stopped only because rank {rank} left the job."
            )
        if self._specific() and diagnosis_fix:
            return diagnosis_fix
        if self.finished and not self.blamed:
            return (
                f"rank {self.root.rank} called a collective that rank(s) "
                f"{', '.join(map(str, self.finished))} never call (the diagnosis names its "
                "file and line): every rank must call each collective, not only under "
                "`if rank == 0:`."
            )
        if self.blamed:
            who = ", ".join(str(r) for r in self.blamed)
            return (
                f"look at where rank(s) {who} were (the diagnosis names the file and line; "
                f"their output lines start with [rank{self.blamed[0]}]:): the other ranks "
                "waited for them until the timeout (or the stall report ended the job)."
            )
        if diagnosis_fix:
            return diagnosis_fix
        return (
            f"see rank {self.root.rank}'s output above (its lines start with "
            f"[rank{self.root.rank}]:); the other ranks were stopped because of it."
        )

    def _specific(self) -> bool:
        """The diagnosis found a cause with a fix of its own (uneven data, batch sizes, another
        collective): its fix beats the generic ones."""
        return self.cause is not None and self.cause[0] in ("uneven", "batch", "mismatch")

    @property
    def exit_code(self) -> int:
        """The root failure's exit code, or 128 + signal for a killed worker (shell convention)."""
        code = self.root.exitcode
        return 128 - code if code < 0 else (code if 0 < code < 256 else 1)


def _stalled(
    failed: list[RankFailure], stalled: dict[int, str], culprits: dict[int, list[int]] | None
) -> tuple[str | None, list[int]]:
    """(headline, blamed) of this node's first failed rank that a stall report named missing."""
    stuck = [f.rank for f in failed if f.rank in stalled]
    return (stalled[stuck[0]], (culprits or {}).get(stuck[0]) or stuck[:1]) if stuck else (None, [])


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


def raisers(
    failures: list[RankFailure],
    diagnoses: dict[int, str],
    raised: dict[int, str],
    signalled: set[int] | None = None,
) -> list[tuple[int, str]]:
    """The ranks that ended on their own exception, with it: failed ranks of this node that
    recorded one and diagnosed nothing (a rank that diagnosed a collective failure only waited
    for someone else), then ranks a diagnosis says raised (on another node, or stopped by
    the launcher before it could record anything)."""
    failed, _ = split_stopped(failures, signalled)
    found = [(f.rank, f.exception) for f in failed if f.exception and f.rank not in diagnoses]
    named = {r for r, _ in found}
    # A rank that diagnosed its own failure waited for someone else, whoever saw it "raise".
    found += [(r, printable(e, 300)) for r, e in sorted(raised.items())
              if r not in named and r not in diagnoses]  # fmt: skip
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
    raisers: list[tuple[int, str]] | None = None,
    cause: tuple[str, list[int]] | None = None,
) -> tuple[str, str | None]:
    """A few lines per failed rank, in the order a person reads them: the headline (the rank
    that raised, or that hung), each failed rank with its traceback's last lines (the cause),
    the ranks the launcher stopped, then the diagnosis, quoted once. Returns the text and the
    diagnosis' own fix (left out of the quote: the summary ends with one fix).

    When a rank diagnosed a failed collective, the first diagnosis (by the failing ranks'
    order, then by rank) is quoted instead of that rank's traceback tail (which ends with the
    same text). When it blames ranks that did not fail themselves (they hung, the others timed
    out waiting), the headline names those ranks.
    """
    failed, stopped = split_stopped(failures, signalled)
    diagnoses = diagnoses or {}
    quoted = _quoted(failed, diagnoses)
    lines = [_headline(failed, world_size, node_rank, blamed, finished, raisers or [], cause)]
    first = {r for r, _ in raisers or []}
    shown: dict[str, int] = {}  # an exception's text -> the rank whose traceback shows it
    for f in sorted(failed, key=lambda f: f.rank not in first):  # who raised comes first
        lines.extend(_failure_lines(f, quoted, shown))
    if stopped:
        lines.append(
            f"  stopped by the launcher: rank(s) {', '.join(str(f.rank) for f in stopped)}"
        )
    fix = None
    if quoted is not None:
        text, fix = _split_fix(diagnoses[quoted])
        lines.append("  diagnosis:")
        lines.extend(f"    {line}" for line in text.splitlines())
    return "\n".join(lines), fix


def _failure_lines(f: RankFailure, quoted: int | None, shown: dict[str, int]) -> list[str]:
    """One failed rank: its cause and its traceback (whole when short, else its last lines),
    or a pointer to its diagnosis, or to the same error shown for an earlier rank."""
    lines = [f"  rank {f.rank} (local_rank {f.local_rank}, pid {f.pid}): {f.cause}"]
    tail = [ln for ln in f.traceback.rstrip().splitlines() if ln.strip() and not _carets(ln)]
    said = _exception_text(tail)
    if f.rank == quoted:
        lines.append("    (its diagnosis is below)")
    elif said and said in shown:  # every rank raising the same error: its text once
        lines.append(f"    raised the same error as rank {shown[said]} (above)")
    else:
        shown.setdefault(said, f.rank)
        keep = len(tail) if len(tail) <= WHOLE_TRACEBACK else TRACEBACK_LINES
        lines.extend(f"    {line}" for line in tail[-keep:])
    if not tail and f.exitcode < 0:
        lines.extend(_no_traceback(f))
    return lines


def _exception_text(tail: list[str]) -> str:
    """The exception's own lines at the end of a traceback (after its last frame's source
    line), or '' for a traceback without frames."""
    frames = [i for i, line in enumerate(tail) if line.lstrip().startswith('File "')]
    return "\n".join(tail[frames[-1] + 2 :]) if frames else ""


def _carets(line: str) -> bool:
    """Python's ``^^^^`` lines under a traceback's source line: noise in a summary."""
    return set(line.strip()) <= set("^~")


def _split_fix(diagnosis: str) -> tuple[str, str | None]:
    """A diagnosis ``[rank r] message\nFix: fix`` as (message, fix)."""
    head, sep, fix = diagnosis.partition("\nFix: ")
    return (head.rstrip(), fix.strip() or None) if sep else (diagnosis, None)


def _headline(
    failed: list[RankFailure],
    world_size: int,
    node_rank: int,
    blamed: list[int] | None,
    finished: list[int] | None,
    raisers: list[tuple[int, str]],
    cause: tuple[str, list[int]] | None = None,
) -> str:
    ranks = ", ".join(str(f.rank) for f in failed)
    where = (
        f"(world size {world_size}, node {node_rank}); every other worker of this node was stopped"
    )
    if raisers:
        rank, exc = raisers[0]
        waited = [f.rank for f in failed if f.rank not in {r for r, _ in raisers}]
        more = "".join(f"; rank {r} raised {e}" for r, e in raisers[1:])
        then = f"; rank(s) {', '.join(map(str, waited))} failed waiting for it" if waited else ""
        return f"rank {rank} raised {exc}{more}{then} {where}"
    if cause is not None and cause[0] == "uneven" and cause[1]:
        left = ", ".join(map(str, cause[1]))
        more = "; those had then finished normally" if finished else ""
        return (
            f"uneven data: rank(s) {left} ran out of batches and left the training loop while "
            f"rank(s) {ranks} still trained{more} (world size {world_size}, node {node_rank})"
        )
    if cause is not None and cause[0] == "batch":
        return (
            f"per-rank batch sizes: rank(s) {ranks} failed in a collective whose tensors' first "
            f"dimension differs between ranks {where}"
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
        message, exception = pf.message, ""
        if isinstance(message, dict):
            exception = _first_line(message.get("message"))
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
                exception=exception,
            )
        )
    return out


def _first_line(message: object) -> str:
    """'ValueError: bad batch' from the error file's message (escaped, at most 300 chars)."""
    if not isinstance(message, str) or not message.strip():
        return ""
    return printable(message.strip().splitlines()[0], 300)
