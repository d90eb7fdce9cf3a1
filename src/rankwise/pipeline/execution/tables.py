"""What the executor reads every step of a schedule and builds once per schedule: each peer's
channel, the acknowledgements in it, where each stream's next message is, and which receives
wait to be posted with a send.

A stream is the messages of one kind from one stage with even, or odd, micro-batch numbers;
over Gloo each travels on a tag of its own (``stream_tag``) with one receive posted ahead, so
a rank can have the next two messages of a kind posted, one per parity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..schedules import Action, Message, Schedule

_TABLES: dict[tuple[int, int], tuple[Schedule, tuple[dict, dict, dict]]] = {}
_DEFERRED: dict[tuple[int, int, bool], tuple[Schedule, tuple[bool, ...]]] = {}
_MAX_KEPT = 256


def stream_tag(msg: Message) -> int:
    """The tag of ``msg``'s stream: its kind, its sending stage, its micro-batch's parity. Over
    Gloo each stream between two ranks is a channel of its own (``p2p.Link``, one receive
    posted ahead on each), so that a pipeline with several stages per rank posts each
    stream's next receive ahead, and a rank can have the next two messages of a kind posted
    (see ``Executor._send``). Tag 0 is left to other traffic (the loss)."""
    return 1 + 4 * msg.src_stage + 2 * (msg.kind == "grad") + msg.micro_batch % 2


def _kept(store: dict, key: tuple, schedule: Schedule, build: Callable[[], Any]) -> Any:
    """``build()`` once per schedule object and key (the schedule is kept with it, so its id
    is not reused while the entry lives)."""
    hit = store.get(key)
    if hit is None or hit[0] is not schedule:
        if len(store) >= _MAX_KEPT:
            store.clear()
        hit = store[key] = (schedule, build())
    return hit[1]


def tables(schedule: Schedule, position: int) -> tuple[dict, dict, dict]:
    """Per peer: the messages it sends ``position`` in one step, in order (the channel); how
    many of this rank's messages it had read before sending each of them (so that reading
    one frees the sends it acknowledges); and ``firsts`` (see there). Read-only, and the same
    every step of a schedule: built once per schedule object (each step rebuilt them from
    every action of its peers, 0.2-0.5 ms of Python a step)."""
    def build() -> tuple[dict, dict, dict]:
        channels = {src: tuple(schedule.sends(src, position)) for src in range(schedule.ranks)
                    if src != position}  # fmt: skip
        acks = {src: tuple(schedule.acks(src, position)) for src in channels}
        return channels, acks, firsts(channels)

    return _kept(_TABLES, (id(schedule), position), schedule, build)


def firsts(channels: dict[int, Sequence[Message]]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Per peer and index ``i`` of its channel: the index of the first message at or after
    ``i`` of each stream (``stream_tag``). A channel interleaves streams in the sender's
    order; each stream's next receive can be posted ahead, not only the channel's next one."""
    out = {}
    for src, channel in channels.items():
        first: dict[int, int] = {}
        rows: list[tuple[int, ...]] = []
        for i in range(len(channel) - 1, -1, -1):
            first[stream_tag(channel[i])] = i
            rows.append(tuple(sorted(first.values())))
        out[src] = tuple(reversed(rows))
    return out


def deferred_posts(
    schedule: Schedule, position: int, todo: Sequence[Action], forward_only: bool
) -> tuple[bool, ...]:
    """For each action of ``todo`` that reads a peer's message: whether the receives of that
    peer's next messages are left to this rank's next send to the peer, which comes before
    the next action that reads from it (``Executor._send`` posts them with the send).

    Over Gloo posting a receive writes a notice to the peer, which wakes the peer's
    communication thread; where the cores are all busy that wake-up can preempt the poster
    and delay its next action. A receive posted with a send to the same peer rides on the
    wake-up the send makes anyway (what ``batch_isend_irecv`` of a send and a receive does),
    and, two messages ahead (one per parity), it is still early."""
    def build() -> tuple[bool, ...]:
        srcs = [_peer(schedule, schedule.needs(a), position, "src") for a in todo]
        dsts = [_peer(schedule, schedule.produces(a), position, "dst") for a in todo]
        out = []
        for k, src in enumerate(srcs):
            later = (j for j in range(k + 1, len(todo)) if src in (srcs[j], dsts[j]))
            first = next(later, None)  # the next action that reads from or sends to src
            out.append(src is not None and first is not None and srcs[first] != src)
        return tuple(out)

    return _kept(_DEFERRED, (id(schedule), position, forward_only), schedule, build)


def _peer(schedule: Schedule, msg: Message | None, position: int, end: str) -> int | None:
    """The other rank of ``msg`` (its sender or its receiver), None for none or this rank."""
    if msg is None:
        return None
    rank = schedule.rank_of(msg.src_stage if end == "src" else msg.dst_stage)
    return None if rank == position else rank
