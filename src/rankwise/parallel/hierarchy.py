"""Which ranks share a machine, and the groups a hierarchical collective runs on.

A job that spans machines is told so by its launcher: every rank's node index (``GROUP_RANK`` /
``NODE_RANK`` under ``rankwise run`` and torchrun, ``SLURM_NODEID`` under Slurm), read by
``env`` and looked up through ``runtime.coords().node``. Never from host names: containers on
one host may share a name, and one host may answer to several.

An engine that could go hierarchical gathers every rank's node index over its process group
at construction (one small all-gather, so every rank takes the same decision). When the ranks
sit on several nodes, each node holding the same number ``L`` of them, a rank belongs to

- its **intra** group: the ``L`` ranks of its node (shared memory, or loopback, between them);
- its **inter** group: the ranks with its own local index on every node, one per node (the
  only ones that talk across the network).

Groups are made once per process group and purpose (the DDP reducer's, ZeRO's reductions,
ZeRO stage 3's gathers: each runs its own worker thread, and two threads must never issue
collectives on one group), in the order the engines ask for them, which is the same on every
rank. They are made by their members alone (``comm.groups.among``): the nodes build their
groups side by side and a subgroup (a mesh's data group) needs nobody else, under one name on
every member whatever groups the user made before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm.groups import among
from ..diagnose import fingerprints
from ..runtime import coords


@dataclass(frozen=True)
class NodeMap:
    """Pure: the group ranks of each node, nodes in order of their first rank."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ids(cls, ids: Sequence[int]) -> NodeMap:
        """``ids[g]``: the node index of group rank ``g``."""
        members: dict[int, list[int]] = {}
        for g, node in enumerate(ids):
            members.setdefault(int(node), []).append(g)
        return cls(tuple(tuple(m) for m in members.values()))

    @property
    def spans_nodes(self) -> bool:
        return len(self.nodes) > 1

    @property
    def per_node(self) -> int:
        """Ranks per node (that of the first node when they differ)."""
        return len(self.nodes[0])

    def uneven(self) -> str | None:
        """Why the groups cannot be made (nodes of different sizes), or None."""
        sizes = [len(m) for m in self.nodes]
        if len(set(sizes)) > 1:
            return f"the nodes hold different numbers of ranks ({sizes})"
        return None

    def node_of(self, g: int) -> int:
        return next(n for n, m in enumerate(self.nodes) if g in m)

    def local_of(self, g: int) -> int:
        return self.nodes[self.node_of(g)].index(g)

    def intra(self, g: int) -> tuple[int, ...]:
        """The group ranks on ``g``'s node."""
        return self.nodes[self.node_of(g)]

    def inter(self, g: int) -> tuple[int, ...]:
        """The group ranks with ``g``'s local index, one per node, in node order."""
        local = self.local_of(g)
        return tuple(m[local] for m in self.nodes)


@dataclass
class Groups:
    """One purpose's pair of groups, and where this rank and its peers sit in them."""

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    local: int
    """This rank's index on its node = its rank in ``intra``."""
    node: int
    """This rank's node = its index in ``inter_ranks``."""
    inter_ranks: list[int]
    """Rank in ``inter`` of this rank's peer on each node (node order)."""


@dataclass
class Hierarchy:
    """A process group's node map and the groups made for it (per purpose, once)."""

    map: NodeMap
    group: dist.ProcessGroup
    ranks: list[int]
    """Global rank of each group rank."""
    rank: int
    """This process's rank in ``group``."""
    _made: dict[str, Groups] = field(default_factory=dict)

    def groups(self, purpose: str) -> Groups:
        """The intra and inter groups for ``purpose``, made on first use.

        Sync point (first use): the ranks of this rank's node, then its peers on other nodes.
        """
        found = self._made.get(purpose)
        if found is not None:
            return found
        backend = dist.get_backend(self.group)
        intra_ranks = [self.ranks[g] for g in self.map.intra(self.rank)]
        peers = [self.ranks[g] for g in self.map.inter(self.rank)]
        # The job's timeout (torch's default is 30 minutes): a cut link must fail here too.
        intra = among(intra_ranks, self.group, backend=backend)
        inter = among(peers, self.group, backend=backend)
        made = Groups(
            intra=intra,
            inter=inter,
            local=dist.get_group_rank(intra, self.ranks[self.rank]),
            node=self.map.node_of(self.rank),
            inter_ranks=[dist.get_group_rank(inter, r) for r in peers],
        )
        self._made[purpose] = made
        return made


_KNOWN: dict[int, tuple[dist.ProcessGroup, NodeMap]] = {}
"""id(group) -> (group, its node map): gathered once per process group (the group is kept so
that its id is never reused)."""


def node_map(group: dist.ProcessGroup | None) -> NodeMap:
    """Every rank's node, gathered once per group. Sync point (first call): the group's ranks."""
    group = group if group is not None else dist.group.WORLD
    found = _KNOWN.get(id(group))
    if found is None:
        mine = torch.tensor([coords().node], dtype=torch.int64)
        out = torch.empty(group.size(), dtype=torch.int64)
        with fingerprints.collective("all_gather", mine, label="node of each rank", group=group):
            dist.all_gather_single(out, mine, group=group)
        found = _KNOWN[id(group)] = (group, NodeMap.from_ids(out.tolist()))
    return found[1]


_HIERARCHIES: dict[int, Hierarchy] = {}


def hierarchy(group: dist.ProcessGroup | None) -> Hierarchy | str:
    """The group's hierarchy, or why it has none ('one node', uneven nodes, one rank per
    node): the same answer on every rank. Sync point (first call): the group's ranks."""
    group = group if group is not None else dist.group.WORLD
    nodes = node_map(group)
    if not nodes.spans_nodes:
        return "every rank is on one node"
    why = nodes.uneven()
    if why is not None:
        return why
    if nodes.per_node < 2:
        return "each node runs one rank (nothing to reduce inside a node)"
    found = _HIERARCHIES.get(id(group))
    if found is None:
        ranks = dist.get_process_group_ranks(group)
        found = _HIERARCHIES[id(group)] = Hierarchy(nodes, group, ranks, group.rank())
    return found
