"""Hierarchical all-reduce of gradient buckets, for a job that spans several nodes.

A flat all-reduce over ranks on several machines sends every byte through the network as if
each rank were alone: Gloo's ring over ``W`` ranks pushes ``2(W-1)/W`` of the bucket through
every link of the ring, and the ring crosses each node boundary. Ranks that share a machine
can sum their gradients first, through shared memory, and send one node's sum instead. With
``L`` ranks on each of ``N`` nodes (``parallel/hierarchy.py``), per large bucket:

1. every rank has put its gradients (divided by ``W = N*L``) in its slot of its node's
   shared-memory file; a barrier among the node's ranks;
2. local rank ``l`` sums chunk ``l`` (of ``L``) over the node's slots (as ``shared_reduce``);
3. local rank ``l`` all-reduces that chunk with the ranks of local index ``l`` on the other
   nodes (Gloo, over the network): its chunk now holds the sum over all ``W`` ranks;
4. local rank ``l`` copies that chunk into the slots of its node's other ranks; a barrier.

This is the reduce-scatter form of the hierarchical all-reduce, chosen over the leader form
(sum the whole bucket on one rank per node, all-reduce between the leaders, broadcast back):
both send the same bytes across the network (``2(N-1)/N`` of the bucket out of each node, the
least any all-reduce can), but here ``L`` ranks each send ``1/L`` of it, on ``L`` connections,
and each sums ``1/L`` of the bucket instead of one rank summing all of it while the others
wait; and steps 1, 2 and 4 are ``shared_reduce``'s own, unchanged. The flat ring, for
comparison, pushes ``2(W-1)/W`` of the bucket through each node boundary: at ``N = L = 2``,
1.5 buckets against 1 (``docs/ddp.md`` has the measured table).

Every chunk is summed once in its node and the cross-node all-reduce gives its participants
identical bytes, so all replicas stay bit-identical. The order of the sum differs from a flat
all-reduce's (node by node), so results match torch's DDP within float rounding, not bit for
bit. Small buckets (under ``shared_reduce.MIN_BYTES``) keep the group's flat all-reduce.

Chosen when the ranks sit on several nodes, each with the same number (2 or more) of them,
over Gloo with CPU buckets (NCCL already builds its rings and trees from the topology), and
shared memory is allowed; ``hierarchical_reduce=False`` turns it off, ``True`` insists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ....diagnose import fingerprints
from ....errors import ConfigError
from ... import hierarchy as hier
from ...buckets import Bucket
from . import shm_file
from .shared_reduce import MIN_BYTES, SharedBuckets, locally_impossible, slot_layout


class HierarchicalBuckets(SharedBuckets):
    """Shared-memory buckets within the node, each chunk all-reduced across the nodes."""

    def __init__(
        self,
        arena: torch.Tensor,
        layout: dict[int, tuple[Bucket, int]],
        slot_bytes: int,
        groups: hier.Groups,
    ) -> None:
        super().__init__(arena, layout, slot_bytes, groups.local, groups.intra)
        self.inter = groups.inter

    def _combine(self, chunk: torch.Tensor) -> None:
        """The node's sum of this rank's chunk, summed over the nodes (run by the channel's
        worker, so the cross-node all-reduces go out in bucket order on every rank)."""
        if chunk.numel():
            dist.all_reduce(chunk, group=self.inter)


def attach(
    buckets: Sequence[Bucket],
    group: dist.ProcessGroup | None,
    enabled: bool | None,
    shared_memory: bool | None,
) -> HierarchicalBuckets | None:
    """Hierarchical buckets for ``group``, or None (the caller decides as for one node).

    ``enabled``: None when the job spans nodes, False never, True insists (a ``ConfigError``
    says why it cannot be). Sync point: all ranks of ``group`` (unless the answer is plain
    locally: off, not Gloo, not CPU, no bucket of 1 MiB).
    """
    group = group if group is not None else dist.group.WORLD
    why_not = _locally_impossible(buckets, group, enabled, shared_memory)
    h = hier.hierarchy(group) if why_not is None else why_not
    if isinstance(h, str):
        return _refuse(h) if enabled else None
    groups = h.groups("ddp")
    layout, slot_bytes = slot_layout(buckets)
    total = shm_file.TOKEN + h.map.per_node * slot_bytes
    made = shm_file.create(total) if groups.local == 0 else None
    arena = shm_file.agree(made, total, dist.get_process_group_ranks(groups.intra), groups.intra)
    ok = torch.tensor([0 if arena is None else 1], dtype=torch.int32)
    with fingerprints.collective("all_reduce", ok, label="hierarchical buckets", group=group):
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() == 0:
        if enabled:
            _refuse(f"a node could not map a {total} byte file in {shm_file.SHM_DIR}")
        return None
    return HierarchicalBuckets(arena, layout, slot_bytes, groups)  # type: ignore[arg-type]


def _locally_impossible(
    buckets: Sequence[Bucket],
    group: dist.ProcessGroup,
    enabled: bool | None,
    shared_memory: bool | None,
) -> str | None:
    """Why this rank can tell alone that the hierarchy is out (the same on every rank)."""
    if enabled is False:
        return "disabled"
    if shared_memory is False:
        return "shared_memory_reduce=False (it sums inside each node through shared memory)"
    why = locally_impossible(buckets, group)
    if why is None and not any(b.nbytes >= MIN_BYTES for b in buckets):
        why = f"no gradient bucket reaches {MIN_BYTES} bytes"
    return why


def _refuse(why: str) -> None:
    raise ConfigError(
        f"hierarchical_reduce=True, but {why}",
        fix="leave hierarchical_reduce unset: it is used whenever the job spans nodes and can.",
    )
