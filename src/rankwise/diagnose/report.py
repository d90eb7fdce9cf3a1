"""Turn what every rank last did into one paragraph: who waits where, who never came, and why.

Pure functions over small records (no torch.distributed here), so the wording is unit-tested
without processes. The shape of a report:

    all_reduce #57 failed on rank 0 after 5.0s (timed out): rank 0 is waiting in barrier #57
    (from train.py:63, inside `if rank == 0`); rank 1 is waiting in all_reduce #57 (bucket 3,
    float32[1024], from train.py:42). The ranks disagree at collective #57: barrier on rank 0,
    all_reduce on rank 1.
"""

from __future__ import annotations

import re

from . import nodes
from .causes import (
    FIX_BATCH,
    FIX_BEHIND,
    FIX_DEAD,
    FIX_FINISHED,
    FIX_MISMATCH,
    FIX_UNEVEN,
    Cause,
    batch_sentence,
    fix_raised,
    guarded_cause,
    guarded_elsewhere,
    is_step,
    raised_sentence,
    uneven_sentence,
)
from .records import LOCAL_FILES, RankView, Record, Site, describe, if_context

__all__ = [
    "FIX_BATCH",
    "FIX_BEHIND",
    "FIX_DEAD",
    "FIX_FINISHED",
    "FIX_MISMATCH",
    "FIX_UNEVEN",
    "LOCAL_FILES",
    "Cause",
    "RankView",
    "Record",
    "Site",
    "classify",
    "clean_backend_error",
    "culprits",
    "decide",
    "describe",
    "disagreement",
    "failure_report",
    "first_divergence",
    "if_context",
    "mismatch_cause",
    "mismatch_report",
    "rank_sentence",
    "stall_report",
]  # fmt: skip


def rank_sentence(view: RankView, want_seq: int) -> str:
    """What one rank is doing, relative to the collective ``want_seq`` that failed."""
    r, rec = view.rank, view.latest
    if view.raised:
        at = f" at {view.frame.short()}" if view.frame else ""
        last = f"after {describe(rec)}" if rec else "before issuing any collective"
        return f"rank {r} raised {view.raised}{at}, {last}: it will never reach #{want_seq}"
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
    found = decide(failed, views)
    text = head + "; ".join(sentences) + "."
    return (f"{text} {found.sentence}" if found.sentence else text), found.fix


def decide(failed: Record, views: list[RankView]) -> Cause:
    """Why ``failed`` cannot complete, in this order: a rank raised; ranks left the training
    loop (uneven data); ranks disagree (per-rank batch sizes, or another collective); a rank
    stopped; ranks finished; ranks never arrived."""
    want = failed.seq
    raised = raised_sentence(views)
    if raised:
        return Cause("raised", raised[0], fix_raised(raised[1]), raised[1])
    guarded = guarded_cause(views)  # a call site inside `if rank == 0:` is never uneven data
    if guarded:
        return guarded
    uneven = uneven_sentence(failed, views)
    if uneven:
        return Cause("uneven", uneven[0], FIX_UNEVEN, uneven[1])
    current = {v.rank: v.latest for v in views if v.latest is not None and v.latest.seq == want}
    disagree = disagreement(current)
    if disagree:
        batch = batch_sentence(current)
        if batch:
            return Cause("batch", f"{disagree} {batch}", FIX_BATCH, sorted(current))
        return Cause("mismatch", disagree, FIX_MISMATCH, sorted(current))
    dead = [v.rank for v in views if v.alive is False and not v.finished]
    finished = [v.rank for v in views if v.finished]
    behind = [v.rank for v in views if v.alive and (v.latest is None or v.latest.seq < want)]
    lost = nodes.lost_nodes(views)
    if lost:  # a whole machine went silent: name it
        ranks = sorted(r for rs in lost.values() for r in rs)
        return Cause("lost", nodes.lost_sentence(lost), nodes.lost_fix(lost), ranks)
    if dead:
        return Cause("dead", "", f"rank(s) {_ranks(dead)} stopped: " + FIX_DEAD, dead)
    if finished:
        called = [v.rank for v in views if not v.finished]
        return Cause(
            "finished",
            f"{failed.op} #{want} was called on rank(s) {_ranks(called)} only: rank(s) "
            f"{_ranks(finished)} finished normally without it.",
            FIX_FINISHED,
            called,
        )
    if behind:
        sentence, fix = f"Rank(s) {_ranks(behind)} never reached #{want}.", FIX_BEHIND
        elsewhere = guarded_elsewhere(views, behind)  # busy under `if rank == 0:`?
        if elsewhere:
            sentence, fix = f"{sentence} {elsewhere[0]}", elsewhere[1]
        return Cause("behind", sentence, fix, behind)
    return Cause(
        "unknown", "",
        "check the backend error above and every rank's log; raise the timeout if the work is slow.",
        [],
    )  # fmt: skip


def culprits(views: list[RankView], want: int) -> list[int]:
    """The ranks to blame for collective ``want`` not completing: those that raised, else those
    that stopped responding, else those alive that never reached it (the waiting ranks are
    their victims). When ranks finished normally instead, the ranks that issued the extra
    collective are to blame: they called it where the others never would."""
    raised = [v.rank for v in views if v.raised]
    if raised:
        return sorted(raised)
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
    found = mismatch_cause(present)
    return (f"{text} {found.sentence}" if found.sentence else text), found.fix


def mismatch_cause(present: dict[int, Record]) -> Cause:
    """Why the ranks' records of one collective number differ: uneven data (one is a training
    step's, another not), per-rank batch sizes, or another collective."""
    views = [RankView(r, rec, True) for r, rec in sorted(present.items())]
    guarded = guarded_cause(views)
    if guarded:
        return guarded
    want = next((rec for rec in present.values() if is_step(rec)), None)
    uneven = uneven_sentence(want, views) if want is not None else None
    if uneven:
        return Cause("uneven", uneven[0], FIX_UNEVEN, uneven[1])
    batch = batch_sentence(present)
    if batch:
        return Cause("batch", batch, FIX_BATCH, sorted(present))
    return Cause("mismatch", "", FIX_MISMATCH, sorted(present))


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
    return clean_backend_error(error)[:200] if error else "failed"


_SOURCE_TAG = re.compile(r"^\[[^\]\s]*\.(?:cc|cpp|h|hpp|cu):\d+\]\s*")
_NOISE = (
    "This is typically caused by a remote worker crashing.",
    "Check the logs of the remote worker before reporting an error.",
    "GLHF!",
)


def clean_backend_error(error: str) -> str:
    """The first line of a backend's error without its noise: Gloo's source tag
    (``[/__w/pytorch/.../pair.cc:553]``) and its boilerplate ("This is typically caused by a
    remote worker crashing. ... GLHF! 🏖️"), which say nothing about this failure."""
    first = next((ln.strip() for ln in error.splitlines() if ln.strip()), "")
    first = _SOURCE_TAG.sub("", first)
    for noise in _NOISE:
        first = first.split(noise)[0] if noise == "GLHF!" else first.replace(noise, "")
    return " ".join(first.split()).rstrip(" .") or error.strip()[:200]


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
