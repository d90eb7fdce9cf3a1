"""Machines, not only ranks: a node whose ranks all went silent, a store this node cannot reach.

On several machines the usual failure is not one rank but a whole node: its processes killed
(an out-of-memory kill of the launcher, a reboot), or the network between the machines cut. The
ranks of the other nodes then see every rank of that node stop responding at once; the ranks of
the cut-off node see the job's store (on the master's machine) stop answering. Pure functions
over the report's ``RankView`` records (read by attribute: no import of ``report``).
"""

from __future__ import annotations

from typing import Any

FIX_LOST_NODE = (
    "find out what happened to node {nodes}: if its processes were killed (its launcher's "
    "log, `dmesg` for the out-of-memory killer) or the machine went down, restart the job "
    "(with --max-restarts and --nnodes MIN:MAX it goes on without waiting for you); if the "
    "machine is up, check the network between it and this node (cable, switch, firewall)."
)
FIX_UNREACHABLE = (
    "check the network between this node and {host} (the job's master, which holds the "
    "store): a cut cable or switch port, a firewall, a down interface; `rankwise doctor` on "
    "this node shows which interface reaches the master."
)


def lost_nodes(views: list[Any]) -> dict[int, list[int]]:
    """``{node: ranks}`` for every node whose ranks (those the side channel knows) all stopped
    responding, while other nodes still answer; empty when the node of a silent rank is
    unknown or a rank of that node is alive."""
    alive_nodes = {v.node for v in views if v.alive and v.node is not None}
    lost: dict[int, list[int]] = {}
    for v in sorted(views, key=lambda v: v.rank):
        if v.alive is False and not v.finished and v.node is not None:
            lost.setdefault(v.node, []).append(v.rank)
    return {n: r for n, r in lost.items() if n not in alive_nodes}


def _nodes(lost: dict[int, list[int]]) -> str:
    return ", ".join(
        f"node {n} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
        for n, r in sorted(lost.items())
    )


def lost_sentence(lost: dict[int, list[int]]) -> str:
    """'Every rank of node 1 (ranks 2, 3) stopped responding: ...' (empty when none is lost)."""
    if not lost:
        return ""
    return (
        f"Every rank of {_nodes(lost)} stopped responding: that machine's processes were "
        "killed or crashed, the machine went down, or the network to it is cut."
    )


def lost_fix(lost: dict[int, list[int]]) -> str:
    return FIX_LOST_NODE.format(nodes=", ".join(str(n) for n in sorted(lost)))


def unreachable_sentence(where: str) -> str:
    """What a rank says when the job's store at ``where`` ('host:port') stopped answering."""
    return (
        f"The job's store at {where} (on the master's machine) did not answer this rank either: "
        "this node is cut off from the master's machine (a network partition), or that machine "
        "is down; the other ranks' states are unknown from here."
    )


def unreachable_fix(where: str) -> str:
    return FIX_UNREACHABLE.format(host=where.rsplit(":", 1)[0])


def gone_sentence(where: str) -> str:
    """What a rank says when the job's store at ``where`` closed or refused its connection."""
    return (
        f"The job's store at {where} (on the master's machine, node 0) closed this rank's "
        "connection: the master's launcher is gone, its node killed or crashed (or the job "
        "ended there); the other ranks' states are unknown from here."
    )


def gone_fix(where: str) -> str:
    host = where.rsplit(":", 1)[0]
    return (
        f"find out what happened to node 0 ({host}): its launcher's output, `dmesg` for the "
        "out-of-memory killer, whether the machine is up; then start the job again (it "
        "resumes from the last checkpoint)."
    )
