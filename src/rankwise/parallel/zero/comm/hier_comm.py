"""ZeRO's collectives across nodes, node first: reduce-scatter, all-reduce, all-gather.

Flat over ``W`` ranks on ``N`` nodes of ``L`` ranks each (``parallel/hierarchy.py``), Gloo's
per-chunk ``reduce``/``broadcast`` (``shard_comm``) send each chunk across the network once per
rank on the other side: for a reduce-scatter, about a whole buffer out of each node. Node
first, the same result needs half of that at ``N = 2`` (``(N-1)/N`` of the buffer):

- **reduce-scatter** (stages 2, 3; rank ``g`` owns chunk ``g`` of ``W``): inside the node,
  each chunk is reduced to the local rank with its owner's local index; then that rank reduces
  each such chunk to its owner, over the ranks of its local index on every node;
- **all-reduce** (stage 1's gradients): inside the node, ``L`` pieces each reduced to one
  local rank; each piece all-reduced across the nodes by its rank; broadcast back in the node;
- **all-gather** (stages 1, 2 after the step, stage 3's parameters): each owner's chunk
  broadcast to the ranks of its local index on the other nodes, then inside each node every
  local rank broadcasts the chunks it holds.

Within a node the data moves through Gloo on loopback (the unit buffers are made and dropped
every step, so they do not live in shared memory as DDP's buckets do). The phases of one call
depend on each other, so a ``Lane`` runs them on one worker thread, call after call in the
order they were made, which is the same on every rank; its ``Work`` (``wait``/``is_completed``)
is watched by the fingerprints like Gloo's own. A lane has its own groups and is shared by every engine on
the process group; stage 3's gathers and the reductions (each ordered alike on every rank,
their interleaving not) get one lane each.
Every chunk has one owner, and an all-reduce's result is the same on every participant, so
ranks agree bit for bit; the order of the sum differs from the flat collectives'.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from ....errors import ConfigError
from ... import hierarchy as hier
from ...ddp.node.shared_reduce import Work


class Lane:
    """Hierarchical collectives on flat buffers, run in call order by one worker thread."""

    def __init__(self, h: hier.Hierarchy, groups: hier.Groups) -> None:
        self.map, self.g = h.map, groups
        self.owner = [(h.map.node_of(r), h.map.local_of(r)) for r in range(len(h.ranks))]
        self.rank = h.rank
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="rankwise-zero-hier", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job, work = self.jobs.get()
            try:
                job()
            except BaseException as exc:  # handed to whoever waits
                work._finish(exc)
            else:
                work._finish()

    def _submit(self, job: Callable[[], None]) -> Work:
        work = Work()
        self.jobs.put((job, work))
        return work

    def reduce_scatter(self, flat: torch.Tensor) -> Work:
        """Sum ``flat`` over the ranks; this rank's chunk (of ``W``) holds its part of the sum;
        the other chunks are left as scratch. Sync point: the group's ranks."""
        return self._submit(lambda: self._reduce_scatter(flat))

    def all_reduce(self, flat: torch.Tensor) -> Work:
        """Sum ``flat`` over the ranks, in place. Sync point: the group's ranks."""
        return self._submit(lambda: self._all_reduce(flat))

    def all_gather(self, flat: torch.Tensor) -> Work:
        """Every rank's chunk of ``flat`` (its own already in place) into every rank's ``flat``.
        Sync point: the group's ranks."""
        return self._submit(lambda: self._all_gather(flat))

    def _reduce_scatter(self, flat: torch.Tensor) -> None:
        g, chunks = self.g, flat.chunk(len(self.owner))
        _all(dist.reduce(c, group=g.intra, group_dst=self.owner[r][1], async_op=True)
             for r, c in enumerate(chunks))  # fmt: skip
        _all(dist.reduce(c, group=g.inter, group_dst=g.inter_ranks[self.owner[r][0]], async_op=True)
             for r, c in enumerate(chunks) if self.owner[r][1] == g.local)  # fmt: skip

    def _all_reduce(self, flat: torch.Tensor) -> None:
        g, per_node = self.g, self.map.per_node
        n = flat.numel()
        pieces = [flat[n * j // per_node : n * (j + 1) // per_node] for j in range(per_node)]
        _all(dist.reduce(p, group=g.intra, group_dst=j, async_op=True)
             for j, p in enumerate(pieces))  # fmt: skip
        dist.all_reduce(pieces[g.local], group=g.inter)
        _all(dist.broadcast(p, group=g.intra, group_src=j, async_op=True)
             for j, p in enumerate(pieces))  # fmt: skip

    def _all_gather(self, flat: torch.Tensor) -> None:
        g, chunks = self.g, flat.chunk(len(self.owner))
        _all(dist.broadcast(c, group=g.inter, group_src=g.inter_ranks[self.owner[r][0]], async_op=True)
             for r, c in enumerate(chunks) if self.owner[r][1] == g.local)  # fmt: skip
        _all(dist.broadcast(c, group=g.intra, group_src=self.owner[r][1], async_op=True)
             for r, c in enumerate(chunks))  # fmt: skip


def _all(works) -> None:
    for work in list(works):
        work.wait()


def lanes(
    group: dist.ProcessGroup | None, world_size: int, stage: int, enabled: bool | None
) -> tuple[Lane | None, Lane | None]:
    """(reductions' lane, gathers' lane), or Nones for the flat collectives.

    ``enabled``: None when the job spans nodes, False never, True insists (a ``ConfigError``
    says why it cannot be). Sync point: the group's ranks (unless off or not Gloo).
    """
    if enabled is False or world_size < 2:
        why: str | hier.Hierarchy = "disabled" if enabled is False else "one rank"
    elif dist.get_backend(group) != "gloo":
        why = f"the process group's backend is {dist.get_backend(group)}, not Gloo (NCCL " \
              "builds its own rings and trees from the topology)"
    else:
        why = hier.hierarchy(group)
    if isinstance(why, str):
        if enabled:
            raise ConfigError(
                f"hierarchical_reduce=True, but {why}",
                fix="leave hierarchical_reduce unset: it is used whenever the job spans nodes.",
            )
        return None, None
    reduce = _lane(why, "zero")
    return reduce, (_lane(why, "zero-gather") if stage == 3 else reduce)


_LANES: dict[tuple[int, str], Lane] = {}
"""(id(hierarchy), purpose) -> its lane, shared by every engine on the group: one thread per
group of collectives, so two engines (a GAN's) never issue on one group from two threads."""


def _lane(h: hier.Hierarchy, purpose: str) -> Lane:
    found = _LANES.get((id(h), purpose))
    if found is None:
        found = _LANES[(id(h), purpose)] = Lane(h, h.groups(purpose))
    return found
