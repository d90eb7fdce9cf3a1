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

    def headline(
        self, blamed: list[int], failed: list[int], world_size: int, node_rank: int
    ) -> str | None:
        """The summary's first line when machines explain the failure, else None."""
        ranks = ", ".join(map(str, failed))
        lost = {n: r for n, r in self.lost.items() if n != node_rank}
        silent = {r for rs in lost.values() for r in rs}
        if lost and set(blamed) <= silent:
            return (
                f"{_nodes(lost)} stopped responding: its processes were killed or crashed, the "
                "machine went down, or the network to it is cut; rank(s) "
                f"{ranks} failed in the collective they were in together (world size "
                f"{world_size}, node {node_rank}); every other worker of this node was stopped"
            )
        if self.unreachable:
            return (
                f"rank(s) {ranks} failed, and the job's store at {self.unreachable} (on the "
                f"master's machine) did not answer them: this node (node {node_rank}) is cut "
                "off from the master's machine, or that machine is down (world size "
                f"{world_size}); every other worker of this node was stopped"
            )
        return None

    def fix(self) -> str:
        if self.lost:
            nodes = ", ".join(str(n) for n in sorted(self.lost))
            return (
                f"find out what happened to node {nodes} (its launcher's output; `dmesg` for "
                "the out-of-memory killer; whether the machine is up and reachable), then "
                "start the job again; with --nnodes MIN:MAX and --max-restarts the others go "
                "on without it and a replacement node can join."
            )
        host = (self.unreachable or "").rsplit(":", 1)[0]
        return (
            f"check the network between this node and {host} (cable, switch port, firewall, "
            "a down interface; `rankwise doctor` here shows which interface reaches it), and "
            "whether that machine is up."
        )


def read_machines(folder: str | os.PathLike) -> Machines:
    """The ``lost`` nodes and ``unreachable`` store that ranks wrote in ``rank<r>.json``."""
    lost: dict[int, list[int]] = {}
    unreachable = None
    for path in sorted(Path(folder).glob("rank*.json")) if Path(folder).is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            for node, ranks in (data.get("lost") or {}).items():
                if str(node).isdigit() and all(isinstance(r, int) for r in ranks):
                    lost[int(node)] = sorted(set(lost.get(int(node), [])) | set(ranks))
            if isinstance(data.get("unreachable"), str):
                unreachable = unreachable or data["unreachable"]
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return Machines(lost, unreachable)
