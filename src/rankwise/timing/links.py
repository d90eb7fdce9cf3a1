"""Which node's link is slow: the pure half of the link probe (``recorder`` runs the probe).

A slow link slows no rank's own work: every rank's busy time stays, and the job's own
communication (the last arrival's blocked time, the same on every rank in a ring) grows. The
ranks cannot tell from their arrival times whose link it is, so when attribution suspects the
links (``Attributor.want_probe``) every rank times a transfer from each of a few peers
(``shifts``: rank r receives from ``(r - k) % world``) and the times are gathered. A pair's
transfer crosses the sender's link out and the receiver's link in: every pair that touches the
slow node is slow, the pairs between the other nodes are not. Each pair of nodes counts with
its fastest transfer, either way: a slow link is slow both ways and every time, while a late
start or a retransmitted packet on a loaded host slows one transfer once. With two nodes every pair touches
both, and no node can be singled out (``slow_node`` returns None).
"""

from __future__ import annotations

import statistics

PROBE_BYTES = 128 << 10
"""Bytes each rank sends to each probed peer: beyond a token bucket's burst (tc tbf's default
64 KiB), so the transfer runs at the link's rate, yet a millisecond on a healthy link."""

RATIO = 3.0
"""The slow node's pairs take this many times the other pairs' median, at least."""


def shifts(world: int) -> list[int]:
    """The peers each rank receives from: ``(r - k) % world`` for k in these (every pair of
    up to four ranks, three neighbours each beyond)."""
    return list(range(1, min(world, 4)))


def slow_node(times: list[list[float]], nodes: list[int]) -> tuple[int, float] | None:
    """(the node all of whose cross-node transfers are slow, how many times slower than the
    transfers between the other nodes), or None when no node stands out (fewer than 3 nodes,
    or no ratio of ``RATIO``). ``times[r][j]``: seconds rank r waited for the probe from
    ``(r - shifts(world)[j]) % world``."""
    world = len(nodes)
    fastest: dict[tuple[int, int], float] = {}  # node pair -> its fastest transfer
    for r in range(world):
        for j, k in enumerate(shifts(world)):
            src = (r - k) % world
            if nodes[src] != nodes[r]:
                pair = (min(nodes[src], nodes[r]), max(nodes[src], nodes[r]))
                fastest[pair] = min(fastest.get(pair, float("inf")), times[r][j])
    best: tuple[int, float] | None = None
    for n in sorted(set(nodes)):
        mine = [t for pair, t in fastest.items() if n in pair]
        rest = [t for pair, t in fastest.items() if n not in pair]
        if not mine or not rest:
            continue
        ratio = statistics.median(mine) / max(statistics.median(rest), 1e-6)
        if best is None or ratio > best[1]:
            best = (n, ratio)
    return best if best is not None and best[1] >= RATIO else None
