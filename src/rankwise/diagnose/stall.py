"""Early stall reports: a collective that waits long is explained, and the job ends.

A rank that hangs before a collective (a sleep, a deadlock in a data loader, a rank-dependent
branch) makes every other rank wait until the backend's timeout (300 s by default), and only
then is anything said. The watchdog thread calls ``check`` at every heartbeat: once a
collective has been pending for ``RANKWISE_STALL_REPORT_S`` seconds (50 by default, so that
the report is out within a minute; 0 turns the reports off), the lowest waiting rank prints
one report naming the waiting ranks, the missing ones and where they are (their call site,
or "running user code at file:line"). A rank cut off from the store prints its own.

Then the job ends (``RANKWISE_ON_STALL=end``, the default): the reporting rank leaves the
report for the launcher (blaming the missing ranks), sets ``END_KEY`` in the store, and ends
(exit code 1) from the watchdog thread, its main thread being inside the backend's wait where
no exception reaches it. Every other rank's watchdog reads ``END_KEY`` at its next heartbeat
(``follow``) and ends the same way, the missing ranks too (one stuck in a data loader, in user
code, never reaches a collective that could fail), each leaving the same blame: the launchers of
every node name the missing ranks, within a few heartbeats of the report, instead of waiting
for the timeout. ``RANKWISE_ON_STALL=wait`` (or ``configure(wait=True)``) keeps the old way:
the report is printed and the job waits, failing at the timeout if the stall does not end.
Each collective is reported once. A stall whose missing ranks are all waiting in a collective
of another group (under a mesh, a tensor-parallel peer of a stuck rank, waiting in the
forward's all-reduce) is left to that group's report, which names the stuck rank, for up to
``DEFER_FACTOR`` times the delay. A ZeRO collective issued under a rank guard
(``if rank == 0: model(x)`` under zero3) is reported after ``causes.GUARDED_SHARDED_S``
already: nothing on the other ranks balances it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from ..job import env as envmod
from . import causes, nodes, report
from .channel import gather, peer

_config: dict[str, Any] = {"after_s": None, "wait": None}
MAX_NAMED = 64  # ranks named one by one in the end note (its size stays bounded)
END_KEY = "rankwise/diag/stall/end"
"""Set in the store by the rank that reported a stall and ends the job: JSON ``{"rank": r,
"missing": [ranks]}``; every rank that reads it ends too (``follow``)."""


def configure(after_s: float | None, *, wait: bool | None = None) -> None:
    """Report collectives pending for ``after_s`` seconds (0: never; None: the environment's);
    ``wait``: after the report, wait for the timeout instead of ending the job (None: the
    environment's ``RANKWISE_ON_STALL``)."""
    if after_s is not None and not after_s >= 0:
        from ..errors import ConfigError

        raise ConfigError(
            f"after_s={after_s!r} must be a number of seconds >= 0",
            fix="pass e.g. 60, or 0 to turn stall reports off.",
        )
    _config["after_s"] = after_s
    _config["wait"] = wait


def waits() -> bool:
    """True when a stall report leaves the job waiting for its timeout (asked for)."""
    configured = _config["wait"]
    return envmod.stall_waits() if configured is None else bool(configured)


def after_s() -> float:
    configured = _config["after_s"]
    return envmod.stall_report_s() if configured is None else configured


def _oldest_pending(g: Any) -> Any | None:
    for e in list(g.ring)[-8:]:
        if e.state in ("entered", "waiting"):
            return e
    return None


def _sharded_guard_overdue(e: Any, waited: float) -> bool:
    """A ZeRO collective under ``if rank == 0:`` is reported early: nothing balances it on the
    other ranks, so waiting the full stall delay only delays the same report. The call site is
    read (from this rank's own file) only once it has waited that long."""
    return waited >= causes.GUARDED_SHARDED_S and causes.sharded_under_guard(e.record())


def check(groups: list[Any], watchdog: Any, interval: float, timeout: float) -> str | None:
    """Report the first collective pending longer than ``after_s()``; returns the report."""
    limit = after_s()
    if limit <= 0 or watchdog is None:
        return None
    now = time.time()
    for g in groups:
        e = _oldest_pending(g)
        if e is None or getattr(g, "stall_reported", 0) >= e.seq:
            continue
        if now - e.t0 < limit and not _sharded_guard_overdue(e, now - e.t0):
            continue
        before, g.stall_reported = getattr(g, "stall_reported", 0), e.seq
        node = getattr(watchdog, "node", None)
        views = gather.collect_views(g, e.record(), watchdog.own, interval, False, node)
        msg, fix = report.stall_report(g.global_rank, e.record(), views, now - e.t0, timeout)
        missing = report.culprits(views, e.seq)
        if defer(now - e.t0, limit, views, missing, watchdog.own, g.name):
            g.stall_reported = before  # checked again at the next heartbeat
            continue
        waiting = [v.rank for v in views if v.rank not in missing]
        missed = getattr(watchdog.own, "missed", None)
        if missed:  # this node is cut off: say so from here (the others are unknown)
            msg = (f"stall: rank {g.global_rank} has been waiting in {report.describe(e.record())} "
                   f"for {now - e.t0:.0f}s. {nodes.unreachable_sentence(missed)}")  # fmt: skip
            fix = nodes.unreachable_fix(missed)
        elif waiting and g.global_rank != min(waiting):
            continue  # one report per stall, from the lowest waiting rank
        waiting_by_design = _long_by_design(e.record())
        text = f"rankwise: [rank {g.global_rank}] {msg}\nFix: {fix}\n" + (
            f"(the job keeps waiting, as RANKWISE_ON_STALL=wait asks; it fails at the timeout "
            f"of {timeout:.0f}s unless the missing rank(s) arrive)"
            if waits()
            else f"(the job keeps waiting: a checkpoint's write may take this long; it fails at "
            f"the timeout of {timeout:.0f}s unless the missing rank(s) arrive)"
            if waiting_by_design
            else "(rankwise ends the job now, every rank with exit code 1; RANKWISE_ON_STALL="
            f"wait waits instead, up to the timeout of {timeout:.0f}s)"
        )
        print(text, file=sys.stderr, flush=True)
        _hang_event(g.global_rank, text)
        if not waits() and not waiting_by_design:
            lost = nodes.lost_nodes(views)
            gather.write_diag_file(g.global_rank, msg, fix, missing, lost=lost,
                                   unreachable=missed, node=node)  # fmt: skip
            facts = end_facts(e.record(), views, missing)
            silent = sum(1 for v in views if v.alive is False)  # they cannot read the note
            _end_job(watchdog, g.global_rank, missing, interval, msg, facts, silent)
        return text
    return None


DEFER_FACTOR = 3.0
"""A stall whose missing ranks all wait in a collective of another group is left, for up to
this many times the stall delay, to the report of that group (``blocked_elsewhere``)."""


def defer(waited: float, limit: float, views: list[Any], missing: list[int], channel: Any,
          group: str) -> bool:  # fmt: skip
    """Leave this stall to another group's report (``blocked_elsewhere``), for up to
    ``DEFER_FACTOR`` times the delay; never when a missing rank stopped responding (its node
    cut off or dead: it is the cause, though its last heartbeat may still show it waiting in
    a mesh's other group; a 3x2 mesh with a host's link cut was reported after 30 s, not 10)."""
    if waited >= DEFER_FACTOR * limit:
        return False
    if any(v.alive is False for v in views if v.rank in missing):
        return False
    return blocked_elsewhere(channel, group, missing)


def blocked_elsewhere(channel: Any, group: str, missing: list[int]) -> bool:
    """True when every rank in ``missing`` is itself waiting in a collective of a group other
    than ``group``, or on a pipeline transfer (its heartbeat says so): it is a victim, not the
    cause (a pipeline stage waits for the gradients of a next stage stuck in its loader, and
    that stage's data-parallel group names it). Under a mesh a rank
    whose tensor-parallel peer is stuck in its data loader waits inside the forward's
    all-reduce, and its data-parallel peers wait for it; the report of the tensor group, by the
    rank waiting there, names the stuck rank. Reading the heartbeats never raises."""
    if not missing:
        return False
    for rank in missing:
        try:
            state = channel.state(rank)
        except Exception:
            return False
        state = state or {}
        if state.get("blocked"):  # waiting on a pipeline transfer from a peer
            continue
        if not any(name != group and recs and recs[-1].state in ("entered", "waiting")
                   for name, recs in (state.get("groups") or {}).items()):  # fmt: skip
            return False
    return True


def end_facts(pending: Any, views: list[Any], missing: list[int]) -> dict:
    """What the end note tells the missing ranks' launchers: the collective they never
    reached, who waited in it, and where each was (``stalled_sentence``)."""
    named = set(missing[:MAX_NAMED])
    where = {str(v.rank): report.rank_sentence(v, pending.seq)[:400] for v in views
             if v.rank in named}  # fmt: skip
    waiting = [v.rank for v in views if v.rank not in set(missing)][:MAX_NAMED]
    return {"op": f"{pending.op} #{pending.seq}", "waiting": waiting, "where": where}


def _hang_event(rank: int, text: str) -> None:
    """The report as a ``hang`` event of the run directory (``rankwise top``, the dashboard)."""
    from .. import timing
    from ..timing import clock, files

    folder = timing.settings_from_env()[1]
    if folder:
        c = clock.current()
        files.append_event(folder, {"step": None if c is None else c.step, "event": "hang",
                                    "text": text, "rank": rank})  # fmt: skip


def _long_by_design(pending: Any) -> bool:
    """A collective that waits for a checkpoint's write (rank 0 writing a large file while the
    others wait for its status): a long wait there is no stall, so it never ends the job (a
    rank that dies meanwhile still fails it)."""
    label = (getattr(pending, "label", None) or "").lower()
    return "checkpoint" in label or "save" in label


def _end_job(
    watchdog: Any,
    rank: int,
    missing: list[int],
    interval: float,
    msg: str,
    facts: dict,
    silent: int = 0,
) -> None:
    """Tell every rank to end (``END_KEY``), wait until the others have read it
    (``await_readers``: each node's launcher then hears the blame from its own ranks, not from
    a peer's closed socket), end first on this node (its launcher quotes this rank's report).
    ``facts``: the pending collective, the waiting ranks and where each missing rank is, for
    the missing ranks' own launchers (``stalled_sentence``)."""
    node = getattr(watchdog, "node", None)
    note = {"rank": rank, "missing": [int(r) for r in missing], "node": node, "msg": msg[:1000],
            **facts}  # fmt: skip
    watchdog.own.set_bounded(END_KEY, json.dumps(note), 2.0)
    await_readers(watchdog, interval, silent)
    _exit(rank, "after the stall report above")


READ_KEY = END_KEY + "/read"
"""A counter: each rank that read ``END_KEY`` adds one (``follow``)."""
READERS_WAIT_S = 6.0
"""How long the reporter waits at most for every other rank to read the end note."""


def await_readers(watchdog: Any, interval: float, silent: int = 0) -> None:
    """Wait until every other rank has read the end note (``READ_KEY``), at least 1.5
    heartbeats and at most ``READERS_WAIT_S``: when this rank ends, its node's launcher ends
    and, on the store's node, the store closes; a rank of another node that had not read the
    note by then heads its node's summary with "the master's machine stopped responding"
    (a fixed 1.5 heartbeats was too short with six workers on two cores). ``silent``: ranks
    known to have stopped responding (a host cut off), not waited for. Never raises."""
    import torch.distributed as dist

    others = (dist.get_world_size() - 1 - silent) if dist.is_initialized() else 0
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        read = watchdog.own.add_bounded(READ_KEY, 0, 2.0)
        if waited >= READERS_WAIT_S or (waited >= 1.5 * interval and (read or 0) >= others):
            return
        if read is None and waited >= 1.5 * interval:
            return  # the store does not answer: nobody can read the note now
        time.sleep(min(0.25, interval))


def _exit(rank: int, why: str) -> None:
    print(f"rankwise: [rank {rank}] ending this rank (exit code 1) {why}: the job ends instead "
          "of waiting for the timeout (RANKWISE_ON_STALL=wait waits).", file=sys.stderr,
          flush=True)  # fmt: skip
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(1)  # the main thread is inside the backend's wait: no exception reaches it


def follow(watchdog: Any, rank: int) -> None:
    """At each heartbeat: end this rank when another rank reported a stall and ended the job
    (``END_KEY``), leaving the same blame for this node's launcher. On the reporter's node,
    a few seconds later (the launcher stops it when the reporter ends, quoting the reporter's
    report); elsewhere at once. Never raises."""
    if watchdog is None or waits() or after_s() <= 0:
        return
    node = getattr(watchdog, "node", None)
    adopted = adopt_end_note(watchdog.own, rank, node)
    if adopted is None:
        return
    note, missing = adopted
    if node is not None and note.get("node") == node:
        time.sleep(3.0)  # the reporter is quoted; a missing rank elsewhere heads with its own
    who = ", ".join(map(str, missing)) or "unknown"
    _exit(rank, f"(rank {note['rank']} reported a stall: rank(s) {who} never arrived)")


def adopt_end_note(channel: Any, rank: int, node: int | None) -> tuple[dict, list[int]] | None:
    """When another rank reported a stall and is ending the job (``END_KEY``): leave its
    blame as this rank's diagnosis for this node's launcher, count this rank as having read
    the note, and return (the note, the missing ranks); None without a note. Also called when
    a collective of this rank fails meanwhile (its peers on other nodes are leaving on the
    note): that failure is the end's consequence, and its own diagnosis would name the
    leaving nodes as lost. Never raises."""
    note = peer.loads(channel.get(END_KEY))
    if not isinstance(note, dict) or not isinstance(note.get("rank"), int):
        return None
    missing = [r for r in note.get("missing") or [] if isinstance(r, int)][:4096]
    reporter, who = note["rank"], ", ".join(map(str, missing)) or "unknown"
    said = peer.text(note.get("msg"), 1000) or f"rank(s) {who} never arrived in a collective"
    msg = f"{said}{_whereabouts(note, missing, said)} (reported by rank {reporter}, which ended the job)"
    fix = f"look at where rank(s) {who} were (the stall report on rank {reporter})."
    stalled = stalled_sentence(note, rank) if rank in missing else None
    gather.write_diag_file(rank, msg, fix, missing, node=node, stalled=stalled)
    channel.add_bounded(READ_KEY, 1, 2.0)  # the reporter waits for every rank's
    note["said"], note["fix"] = msg, fix
    return note, missing


def _whereabouts(note: dict, missing: list[int], said: str) -> str:
    """Where the first missing ranks were, for those the reporter's message, cut at 1,000
    characters, no longer holds (nine ranks waiting in one collective fill it before the
    highest rank's sentence: the stuck rank 8 of a 3 x 3 job went unplaced)."""
    where = note.get("where") if isinstance(note.get("where"), dict) else {}
    lacking = [text for r in missing[:4] if (text := peer.text(where.get(str(r)), 400))
               and text not in said]  # fmt: skip
    return f" Where: {'; '.join(lacking)}." if lacking else ""


def stalled_sentence(note: dict, rank: int) -> str:
    """What a missing rank's own launcher heads its summary with (it ended on the report, so
    its exit code says nothing): which collective it never reached, who waited in it, and
    where the reporter saw it. ``note``: the reporter's ``END_KEY`` value (a peer's: checked)."""
    waiting = [r for r in note.get("waiting") or [] if isinstance(r, int)][:MAX_NAMED]
    where = note.get("where") if isinstance(note.get("where"), dict) else {}
    seen = peer.text(where.get(str(rank)), 400) or f"rank {rank} never reported where it was"
    op = peer.text(note.get("op"), 100) or "a collective"
    who = ", ".join(map(str, waiting)) or "the other ranks"
    return (f"rank {rank} never reached {op}, which rank(s) {who} waited in until rank "
            f"{note['rank']} reported the stall and ended the job; there, {seen}")  # fmt: skip
