"""Turn what every rank last did into one paragraph: who waits where, who never came, and why.

Pure functions over small records (no torch.distributed here), so the wording is unit-tested
without processes. The shape of a report:

    all_reduce #57 failed on rank 0 after 5.0s (timed out): rank 0 is waiting in barrier #57
    (from train.py:63, inside `if rank == 0`); rank 1 is waiting in all_reduce #57 (bucket 3,
    float32[1024], from train.py:42). The ranks disagree at collective #57: barrier on rank 0,
    all_reduce on rank 1.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from . import nodes


class Site(NamedTuple):
    """A place in the user's code (a tuple: made on every collective, so it must be cheap)."""

    file: str
    line: int
    func: str

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass(frozen=True)
class Record:
    """One collective as one rank saw it."""

    seq: int
    op: str
    sig: str
    """Operation details and tensor signature, e.g. 'sum, float32[1024]'."""
    label: str | None
    site: Site | None
    state: str
    """'entered' (published before issuing), 'waiting', 'done' or 'failed'."""
    digest: int


@dataclass(frozen=True)
class RankView:
    """What the side channel says about one rank."""

    rank: int
    latest: Record | None
    alive: bool | None
    """False: no heartbeat for a while (killed, crashed or frozen); None: never reported."""
    silent_s: float | None = None
    """Seconds since its last heartbeat."""
    frame: Site | None = None
    """Where its main thread was at its last heartbeat (user code); for a finished rank, where
    it called ``rw.shutdown`` (None at a clean exit)."""
    finished: bool = False
    """It ended normally (``rw.shutdown`` or a clean exit): it will issue no more collectives."""
    node: int | None = None
    """Its node (machine) index, from its heartbeat; None when unknown."""


@lru_cache(maxsize=64)
def _parsed(path: str, mtime: float) -> tuple[ast.AST, str] | None:
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        return ast.parse(source), source
    except (OSError, SyntaxError, ValueError):
        return None


def if_context(path: str, line: int) -> str | None:
    """The innermost ``if`` around ``line`` in ``path``: "inside `if rank == 0`" (best effort)."""
    try:
        parsed = _parsed(path, os.path.getmtime(path))
    except OSError:
        return None
    if parsed is None:
        return None
    tree, source = parsed
    best: tuple[int, str] | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        for branch, inside in ((node.body, "inside"), (node.orelse, "in the else of")):
            if branch and branch[0].lineno <= line <= (branch[-1].end_lineno or line):
                depth = branch[0].lineno  # the innermost branch starts last
                if best is None or depth >= best[0]:
                    test = ast.get_source_segment(source, node.test) or ast.unparse(node.test)
                    test = test if len(test) <= 60 else test[:57] + "..."
                    best = (depth, f"{inside} `if {test}`")
    return None if best is None else best[1]


def describe(rec: Record, *, context: bool = True) -> str:
    """'all_reduce #57 (bucket 3, float32[1024], from train.py:42, inside `if rank == 0`)'."""
    details = [part for part in (rec.label, rec.sig) if part]
    if rec.site is not None:
        details.append(f"from {rec.site.short()}")
        where = if_context(rec.site.file, rec.site.line) if context else None
        if where:
            details.append(where)
    return f"{rec.op} #{rec.seq}" + (f" ({', '.join(details)})" if details else "")


def rank_sentence(view: RankView, want_seq: int) -> str:
    """What one rank is doing, relative to the collective ``want_seq`` that failed."""
    r, rec = view.rank, view.latest
    if view.finished:
        where = f" (rw.shutdown at {view.frame.short()})" if view.frame else ""
        last = f"after {describe(rec)}" if rec else "without issuing any collective"
        return f"rank {r} had already finished normally{where}, {last}: it will never reach #{want_seq}"
    if view.alive is None and rec is None:
        return f"rank {r} never reported (not started yet, or died before its first collective)"
    if view.alive is False:
        silent = "" if view.silent_s is None else f" {view.silent_s:.1f}s ago"
        last = f"; its last collective was {describe(rec)}" if rec else ""
        if rec is not None and rec.seq > want_seq:
            # Asynchronous collectives (DDP's buckets) are numbered when issued: it issued
            # #want and later ones, then stopped before its part of #want was done.
            last = f"; it had issued #{want_seq} and more, up to {describe(rec)}, but never completed #{want_seq}"
        seen = f", last seen at {view.frame.short()}" if view.frame else ""
        return f"rank {r} stopped responding{silent} (killed, crashed or frozen{seen}){last}"
    if rec is None:
        where = f", running user code at {view.frame.short()}" if view.frame else ""
        return f"rank {r} has not issued any collective yet{where}"
    if rec.state in ("entered", "waiting", "failed") and rec.seq >= want_seq:
        return f"rank {r} is waiting in {describe(rec)}"
    if rec.state in ("entered", "waiting", "failed"):
        return f"rank {r} is waiting in {describe(rec)}, behind #{want_seq}"
    where = f" and is running user code at {view.frame.short()}" if view.frame else ""
    return (
        f"rank {r} has not reached #{want_seq}: it finished {describe(rec)}{where}"
        if rec.seq < want_seq
        else f"rank {r} finished {describe(rec)}{where}"
    )


def disagreement(records: dict[int, Record]) -> str | None:
    """A sentence naming the ranks that issue different collectives at the same number."""
    by_seq: dict[int, dict[int, Record]] = {}
    for rank, rec in records.items():
        by_seq.setdefault(rec.seq, {})[rank] = rec
    for seq in sorted(by_seq):
        group = by_seq[seq]
        if len({rec.digest for rec in group.values()}) > 1:
            parts = [f"{_what(rec)} on rank {rank}" for rank, rec in sorted(group.items())]
            return f"The ranks disagree at collective #{seq}: {', '.join(parts)}."
    return None


def _what(rec: Record) -> str:
    return f"{rec.op}({rec.sig})" if rec.sig else rec.op


FIX_MISMATCH = (
    "every rank must issue the same collectives, in the same order, with the same shapes and "
    "dtypes; look at the call sites above for a collective inside a rank-dependent branch "
    "(`if rank == 0:`) or a tensor whose shape depends on the rank's data."
)
FIX_DEAD = (
    "read the log of the rank that stopped: its first error is the cause (a rank killed by the "
    "OS, e.g. out of memory, leaves no Python traceback; `dmesg` shows it)."
)
FIX_FINISHED = (
    "every rank must call each collective: this one ran on some ranks only (look at its call "
    "site above: a collective under `if rank == 0:`), and the others ended their script without "
    "it. Call it on every rank and use its result on rank 0 only, or drop it."
)
FIX_BEHIND = (
    "every rank must reach the same collectives; the rank(s) named above are busy elsewhere "
    "(a collective skipped under a condition, an endless loop, or a much slower step). "
    "If the work is just slow, raise the timeout: rw.init(timeout=...)."
)


def failure_report(
    me: int,
    failed: Record,
    views: list[RankView],
    cause: str,
    elapsed: float,
    verb: str = "failed",
) -> tuple[str, str]:
    """Message and fix for a collective that timed out or failed (or is stuck) on rank ``me``."""
    want = failed.seq
    sentences = [rank_sentence(v, want) for v in sorted(views, key=lambda v: v.rank)]
    head = f"{failed.op} #{want} {verb} on rank {me} after {elapsed:.1f}s ({cause}): "
    text = head + "; ".join(sentences) + "."
    current = {v.rank: v.latest for v in views if v.latest is not None and v.latest.seq == want}
    disagree = disagreement(current)
    dead = [v.rank for v in views if v.alive is False and not v.finished]
    finished = [v.rank for v in views if v.finished]
    behind = [v.rank for v in views if v.alive and (v.latest is None or v.latest.seq < want)]
    if disagree:
        return f"{text} {disagree}", FIX_MISMATCH
    lost = nodes.lost_nodes(views)
    if lost:  # a whole machine went silent: name it
        return f"{text} {nodes.lost_sentence(lost)}", nodes.lost_fix(lost)
    if dead:
        return text, f"rank(s) {_ranks(dead)} stopped: " + FIX_DEAD
    if finished:
        called = [v.rank for v in views if not v.finished]
        return (
            f"{text} {failed.op} #{want} was called on rank(s) {_ranks(called)} only: rank(s) "
            f"{_ranks(finished)} finished normally without it.",
            FIX_FINISHED,
        )
    if behind:
        return f"{text} Rank(s) {_ranks(behind)} never reached #{want}.", FIX_BEHIND
    return (
        text,
        "check the backend error above and every rank's log; raise the timeout if the work is slow.",
    )


def culprits(views: list[RankView], want: int) -> list[int]:
    """The ranks to blame for collective ``want`` not completing: those that stopped
    responding, else those alive that never reached it (the waiting ranks are their victims).
    When ranks finished normally instead, the ranks that issued the extra collective are
    to blame: they called it where the others never would."""
    dead = [v.rank for v in views if v.alive is False and not v.finished]
    if dead:
        return sorted(dead)
    if any(v.finished for v in views):
        return sorted(v.rank for v in views if not v.finished and v.latest and v.latest.seq >= want)
    return sorted(v.rank for v in views if v.alive and (v.latest is None or v.latest.seq < want))


def stall_report(me: int, pending: Record, views: list[RankView], waited: float, timeout: float):
    """Message and fix for a collective still waiting after ``waited`` s (the job goes on)."""
    missing = culprits(views, pending.seq)
    waiting = [v.rank for v in views if v.rank not in missing]
    msg, fix = failure_report(
        me, pending, views, f"the timeout is {timeout:.0f}s", waited, "is still pending"
    )
    if missing:
        # A rank that froze after issuing later (asynchronous) collectives did reach this one.
        ahead = any(v.latest is not None and v.latest.seq >= pending.seq
                    for v in views if v.rank in missing)  # fmt: skip
        verb = "stopped before completing" if ahead else "have not reached"
        lost = nodes.lost_nodes(views)
        if lost and sorted(r for ranks in lost.values() for r in ranks) == missing:
            verb = f"({', '.join(f'node {n}' for n in sorted(lost))}) stopped responding during"
        head = (
            f"stall: rank(s) {_ranks(missing)} {verb} {pending.op} #{pending.seq}, "
            f"which rank(s) {_ranks(waiting)} have been waiting in for {waited:.0f}s. "
        )
        msg = head + msg
    return msg, fix


def mismatch_report(me: int, seq: int, records: dict[int, Record | None]) -> tuple[str, str]:
    """Message and fix when the fingerprints of collective ``seq`` differ between ranks."""
    parts = []
    for rank, rec in sorted(records.items()):
        if rec is None:
            parts.append(f"rank {rank} has no record of #{seq} (it issued fewer collectives)")
        else:
            parts.append(f"rank {rank} calls {describe(rec)}")
    present = {r: rec for r, rec in records.items() if rec is not None}
    tail = disagreement(present) or ""
    text = (
        f"collectives disagree across ranks, caught on rank {me} before collective #{seq} "
        f"could exchange data: {'; '.join(parts)}. {tail}"
    ).rstrip()
    return text, FIX_MISMATCH


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def classify(error: str) -> str:
    """A short cause from a backend's error text."""
    low = error.lower()
    if "closed by peer" in low or "connection reset" in low or "broken pipe" in low:
        return "a peer closed its connection"
    if "monitoredbarrier" in low:
        return "timed out in a monitored barrier"
    if "timed out" in low or "timeout" in low:
        return "timed out"
    return error.splitlines()[0][:200] if error else "failed"


def first_divergence(rings: dict[int, list[Record]]) -> tuple[int, dict[int, Record | None]]:
    """The first collective number where the ranks' histories differ, and each rank's record.

    Only numbers every non-empty history still holds are compared, so older divergences (out
    of the history) show as the oldest number kept.
    """
    by_rank = {r: {rec.seq: rec for rec in ring} for r, ring in rings.items()}
    filled = [m for m in by_rank.values() if m]
    if not filled:
        return 0, dict.fromkeys(rings)
    lo = max(min(m) for m in filled)
    hi = max(max(m) for m in filled)
    for seq in range(lo, hi + 1):
        recs = {r: m.get(seq) for r, m in by_rank.items()}
        if len({None if rec is None else rec.digest for rec in recs.values()}) > 1:
            return seq, recs
    return hi, {r: m.get(hi) for r, m in by_rank.items()}
