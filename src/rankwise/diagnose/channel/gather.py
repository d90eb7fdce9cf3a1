"""Gather every rank's last collectives over the side channel and build the diagnosis.

Used only when something is wrong (a check found a mismatch, a collective failed or timed out),
never on the hot path. Nothing here uses the process group, except the agreement check itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import DistributedError
from ...job import env as envmod
from .. import nodes, report
from ..report import RankView, Record, Site
from . import peer
from .sidechannel import Channel, key_last, key_ring

_FIX_UNTRACKED = (
    "every rank must reach the same collectives; check every rank's log for the first error, "
    "or turn fingerprints on (rankwise.diagnose.fingerprints.configure(enabled=True)) for a diagnosis."
)


def check(g: Any, e: Any, interval: float, watchdog: Any) -> None:
    """All-gather ``(seq, rolling hash)``; raise the diagnosis when the ranks differ.

    Sync point: the ranks of ``g``.
    """
    mine = torch.tensor([e.seq, g.rolling], dtype=torch.int64)
    if g.device is not None:
        mine = mine.to(g.device)
    out = [torch.empty_like(mine) for _ in range(g.size)]
    try:
        dist.all_gather(out, mine, group=g.pg)
    except Exception as exc:
        raise failure_error(e, exc, interval, watchdog, g.channel) from exc
    values = {tuple(t.tolist()) for t in out}
    if len(values) > 1:
        raise mismatch_error(g, e, interval)


@dataclass(frozen=True)
class _Peer:
    beat: float | None
    frame: Site | None
    latest: Record | None
    finished: bool = False
    raised: str | None = None
    node: int | None = None


def _read(channel: Channel, group: str, rank: int) -> _Peer:
    """What the store says of ``rank`` (every value checked and escaped by ``peer``)."""
    state = channel.state(rank)
    latest = None
    entries = (state or {}).get("groups", {}).get(group) or []
    if entries:
        latest = entries[-1]
    wired = peer.parse_wire(channel.get(key_last(group, rank)))
    if wired is not None and (latest is None or wired[0].seq > latest.seq):
        latest = wired[0]
    frame = state["frame"] if state else None
    beat = state["t"] if state else None
    node = (state or {}).get("node")  # its machine: a node whose ranks all went silent is named
    raised = channel.raised(rank)
    if raised is not None:  # it ended on an exception: where it came from, and what
        return _Peer(beat, raised["site"], latest, False, raised["error"], node)
    done = channel.finished(rank)
    if done is not None:  # it ended normally: where it called rw.shutdown, if it did
        frame = done["site"]
    return _Peer(beat, frame, latest, done is not None, node=node)


def collect_views(
    g: Any, mine: Record, channel: Channel, interval: float, settle: bool, node: int | None = None
) -> list[RankView]:
    """Every rank's view. A rank counts as alive when its heartbeat advances (``settle``: wait
    for that until it has been silent ``SILENT_BEATS`` heartbeats, ``_settle_s``) or, after a
    timeout, when its heartbeat is recent."""
    me = g.global_rank
    others = [r for r in g.ranks if r != me]
    first = {r: _read(channel, g.name, r) for r in others}
    latest, alive, done = dict(first), set(), set()
    start = time.monotonic()
    deadline = {r: start + (_settle_s(p, interval) if settle else 0.0) for r, p in first.items()}
    while True:
        now = time.time()
        for r in others:
            if r in alive or r in done:
                continue
            cur = latest[r] = _read(channel, g.name, r)
            advanced = (
                cur.beat is not None and first[r].beat is not None and cur.beat > first[r].beat
            )
            recent = cur.beat is not None and not settle and now - cur.beat < 2.5 * interval
            failed = cur.latest is not None and cur.latest.state == "failed"
            if advanced or recent or failed:  # a rank that reported its own failure is no corpse
                alive.add(r)
            elif cur.finished or cur.raised:  # settled: it ended, no heartbeat will come
                done.add(r)
        cut_off = getattr(channel, "missed", None)  # no answer from the store: stop asking
        waited = time.monotonic()
        if all(r in alive or r in done or waited >= deadline[r] for r in others) or cut_off:
            break
        time.sleep(interval / 4)
    views = [RankView(me, mine, True, node=node)]
    for r in others:
        cur = latest[r]
        state = True if r in alive else (None if cur.beat is None and cur.latest is None else False)
        silent = None if cur.beat is None else max(0.0, time.time() - cur.beat)
        finished = r not in alive and cur.finished
        raised = cur.raised if r not in alive else None
        views.append(RankView(r, cur.latest, state, silent, cur.frame, finished, raised, cur.node))
    return views


SILENT_BEATS = 2.5
"""A rank whose heartbeat has not advanced for this many heartbeats stopped responding."""
SEEN_BEATS = 1.5
"""...counted from its last heartbeat, but watched for at least this many: a live rank beats
once per heartbeat, so one with a clock behind ours (another machine's) still shows it."""


def _settle_s(peer_state: _Peer, interval: float) -> float:
    """How long to watch a rank for a heartbeat: until its silence, counted from its own last
    heartbeat (not from now: a rank killed a moment ago has been silent since its last beat),
    reaches ``SILENT_BEATS``; never under ``SEEN_BEATS``, never over ``SILENT_BEATS``."""
    if peer_state.beat is None:
        return SILENT_BEATS * interval
    age = min(max(0.0, time.time() - peer_state.beat), SILENT_BEATS * interval)
    return max(SEEN_BEATS * interval, SILENT_BEATS * interval - age)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return report.clean_backend_error(text)[:300] if text else type(exc).__name__


def failure_error(
    entry: Any, exc: BaseException, interval: float, watchdog: Any, channel: Any, mark: bool = True
) -> DistributedError:
    """The ``DistributedError`` for ``entry`` failing with ``exc`` (``mark``: it really failed)."""
    first = _first_line(exc)
    cause = report.classify(str(exc))
    elapsed = time.time() - entry.t0
    g = entry.group
    if g is None or channel is None:
        rank = dist.get_rank() if dist.is_initialized() else None
        return DistributedError(
            f"{entry.op} failed after {elapsed:.1f}s ({cause}): {first}",
            fix=_FIX_UNTRACKED,
            rank=rank,
        )
    if mark:
        entry.state, entry.error = "failed", first
        if watchdog is not None:
            watchdog.beat(channel)  # tell the others at once that this rank is alive and failing
    node = getattr(watchdog, "node", None)
    views = collect_views(
        g, entry.record(), channel, interval, settle="timed out" not in cause, node=node
    )
    verb = "failed" if mark else "is still pending"
    cause = cause if mark else first
    msg, fix = report.failure_report(g.global_rank, entry.record(), views, cause, elapsed, verb)
    missed, gone = getattr(channel, "missed", None), getattr(channel, "gone", None)
    found = report.decide(entry.record(), views)
    if missed or gone:  # cut off from the store, or its host died: the others are unknown
        head = f"{entry.op} #{entry.seq} {verb} on rank {g.global_rank} after {elapsed:.1f}s"
        says = nodes.unreachable_sentence(missed) if missed else nodes.gone_sentence(gone)
        msg = f"{head} ({cause}). {says}"
        fix = nodes.unreachable_fix(missed) if missed else nodes.gone_fix(gone)
        found = None
    if mark and cause != "a peer closed its connection":  # else it adds only an address
        msg = f"{msg}\n(backend error on rank {g.global_rank}: {first})"
    finished = [v.rank for v in views if v.finished]
    raised = {v.rank: v.raised for v in views if v.raised}
    culprits = report.culprits(views, entry.seq)
    write_diag_file(g.global_rank, msg, fix, culprits, finished, raised, found,
                    lost=nodes.lost_nodes(views), unreachable=missed, gone=gone, node=node)  # fmt: skip
    err = DistributedError(msg, fix=fix, rank=g.global_rank)
    # Caused by other ranks (they raised, or never came): this rank only waited for them, and
    # must not be announced as one more rank that "raised" (watch.announce_raised).
    err.waited_for = sorted((set(raised) | set(culprits)) - {g.global_rank})
    return err


def _rings(g: Any, seq: int, interval: float) -> dict[int, list[Record]]:
    """Every rank's history, published by each rank as it finds the same mismatch."""
    channel, me = g.channel, g.global_rank
    ring = list(g.ring)
    channel.set(key_ring(g.name, me), json.dumps({"seq": seq, "ring": [e.to_dict() for e in ring]}))
    rings = {me: [e.record() for e in ring]}
    pending = [r for r in g.ranks if r != me]
    deadline = time.monotonic() + max(2.0, 2.5 * interval)
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            raw = channel.get(key_ring(g.name, r))
            if raw:
                ring = peer.loads(raw)
                rings[r] = peer.records(ring.get("ring") if isinstance(ring, dict) else None)
                pending.remove(r)
        if pending:
            time.sleep(0.02)
    for r in pending:  # it did not answer: its last published collective is all we know
        wired = peer.parse_wire(channel.get(key_last(g.name, r)))
        rings[r] = [wired[0]] if wired else []
    return rings


def mismatch_error(g: Any, e: Any, interval: float) -> DistributedError:
    """The ``DistributedError`` for fingerprints that differ at (or before) ``e``."""
    e.state, e.error = "failed", "fingerprint mismatch"
    seq, records = report.first_divergence(_rings(g, e.seq, interval))
    msg, fix = report.mismatch_report(g.global_rank, seq, records)
    present = {r: rec for r, rec in records.items() if rec is not None}
    write_diag_file(g.global_rank, msg, fix, cause=report.mismatch_cause(present))
    return DistributedError(msg, fix=fix, rank=g.global_rank)


def write_diag_file(
    rank: int,
    message: str,
    fix: str,
    culprits: list[int] | None = None,
    finished: list[int] | None = None,
    raised: dict[int, str] | None = None,
    cause: report.Cause | None = None,
    stalled: str | None = None,
    **machines: Any,
) -> None:
    """Leave the diagnosis where the launcher looks (``RANKWISE_DIAG_DIR``): ``rank<r>.txt``,
    and ``rank<r>.json`` naming the ranks to blame, those that had finished normally and
    those that raised, with their exception, and the cause found (the launcher's headline);
    ``machines``: ``lost`` (``{node: ranks}`` that all stopped responding), ``unreachable``
    (the store's 'host:port' when it did not answer), ``gone`` (... when it closed the
    connection) and ``node`` (this rank's node); ``stalled``: the headline of a rank that a
    stall report named as missing (where it was, ``stall.stalled_sentence``)."""
    folder = envmod.diag_dir()
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{rank}.txt"), "w", encoding="utf-8") as f:
            f.write(f"[rank {rank}] {message}\nFix: {fix}\n")
        with open(os.path.join(folder, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            facts = {
                "culprits": culprits or [],
                "finished": finished or [],
                "raised": {str(r): e for r, e in (raised or {}).items()},
                "cause": None if cause is None else {"tag": cause.tag, "ranks": cause.ranks},
                "lost": {str(n): r for n, r in (machines.get("lost") or {}).items()},
                "unreachable": machines.get("unreachable"),
                "gone": machines.get("gone"),
                "node": machines.get("node"),
                "stalled": stalled,
            }
            json.dump(facts, f)
    except OSError:
        pass


def log_overdue(err: DistributedError) -> None:
    """A collective is about to hit the backend's timeout: say why now, before the abort."""
    print(f"rankwise: a collective is stuck (timeout soon):\n{err}", file=sys.stderr, flush=True)
