"""What the failure summary says about machines: a node that went silent, a master out of reach.

The ranks' diagnoses (``rankwise.diagnose``, ``rank<r>.json`` in the diagnoses folder) say
which nodes had every rank stop responding (``lost``) and whether the job's store on the
master's machine stopped answering this node (``unreachable``). On several machines that is
the headline: "node 1 (ranks 2, 3) stopped responding", not "ranks 2, 3 never reached ...".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


def _nodes(lost: dict[int, list[int]]) -> str:
    return ", ".join(
        f"node {n} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
        for n, r in sorted(lost.items())
    )


@dataclass(frozen=True)
class Machines:
    """Nodes whose ranks all stopped responding, and the store this node could not reach."""

    lost: dict[int, list[int]] = field(default_factory=dict)
    """``{node: ranks}``: every rank of that node stopped responding."""
    unreachable: str | None = None
    """The job's store ('host:port') when it stopped answering this node's ranks."""
    gone: str | None = None
    """The job's store ('host:port') when it closed their connections: node 0 died."""

    def kind(self, blamed: list[int], node_rank: int) -> str | None:
        """What explains the failure seen on node ``node_rank``: 'lost' (another node's ranks
        all went silent, and they are the ones blamed), 'gone' (node 0's store closed the
        connections), 'unreachable' (it stopped answering), or None."""
        lost = {r for n, rs in self.lost.items() if n != node_rank for r in rs}
        if lost and set(blamed) <= lost:
            return "lost"
        if self.gone and node_rank != 0:
            return "gone"
        return "unreachable" if self.unreachable else None

    def headline(
        self, blamed: list[int], failed: list[int], world_size: int, node_rank: int
    ) -> str | None:
        """The summary's first line when machines explain the failure, else None."""
        ranks, kind = ", ".join(map(str, failed)), self.kind(blamed, node_rank)
        where = (
            f"(world size {world_size}, node {node_rank}); every other worker of this node was "
            "stopped"
        )
        if kind == "lost":
            lost = {n: r for n, r in self.lost.items() if n != node_rank}
            return (
                f"{_nodes(lost)} stopped responding: its processes were killed or crashed, the "
                "machine went down, or the network to it is cut; rank(s) "
                f"{ranks} failed in the collective they were in together {where}"
            )
        if kind == "gone":
            return (
                f"node 0 (the master's machine, whose store at {self.gone} closed the "
                "connections) stopped responding: its processes were killed or crashed, or the "
                f"machine went down; rank(s) {ranks} failed {where}"
            )
        if kind == "unreachable":
            return (
                f"rank(s) {ranks} failed, and the job's store at {self.unreachable} (on the "
                f"master's machine) did not answer them: this node (node {node_rank}) is cut "
                f"off from the master's machine, or that machine is down {where}"
            )
        return None

    def fix(self, blamed: list[int], node_rank: int) -> str:
        kind = self.kind(blamed, node_rank)
        if kind == "lost":
            nodes = ", ".join(str(n) for n in sorted(self.lost) if n != node_rank)
            return (
                f"find out what happened to node {nodes} (its launcher's output; `dmesg` for "
                "the out-of-memory killer; whether the machine is up and reachable), then "
                "start the job again; with --nnodes MIN:MAX and --max-restarts the others go "
                "on without it and a replacement node can join."
            )
        if kind == "gone":
            return (
                f"find out what happened to node 0 ({(self.gone or '').rsplit(':', 1)[0]}): "
                "its launcher's output, `dmesg` for the out-of-memory killer, whether the "
                "machine is up; then start the job again (it resumes from the last checkpoint)."
            )
        host = (self.unreachable or "").rsplit(":", 1)[0]
        return (
            f"check the network between this node and {host} (cable, switch port, firewall, "
            "a down interface; `rankwise doctor` here shows which interface reaches it), and "
            "whether that machine is up."
        )


def read_machines(folder: str | os.PathLike) -> Machines:
    """The ``lost`` nodes and the ``unreachable`` or ``gone`` store that ranks wrote in
    ``rank<r>.json``."""
    lost: dict[int, list[int]] = {}
    unreachable = gone = None
    for path in sorted(Path(folder).glob("rank*.json")) if Path(folder).is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            for node, ranks in (data.get("lost") or {}).items():
                if str(node).isdigit() and all(isinstance(r, int) for r in ranks):
                    lost[int(node)] = sorted(set(lost.get(int(node), [])) | set(ranks))
            if isinstance(data.get("unreachable"), str):
                unreachable = unreachable or data["unreachable"]
            if isinstance(data.get("gone"), str):
                gone = gone or data["gone"]
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return Machines(lost, unreachable, gone)
