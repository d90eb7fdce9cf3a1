"""Groups made by their members alone, under one name on every member.

rankwise makes a node's group, the node leaders' group and ZeRO-3's gather group with torch's
``use_local_synchronization=True``: only the members meet, so the nodes (or a mesh's data
groups) build theirs side by side. torch names such a group from its ranks *and the number of
groups this process belongs to*; a process joins only the groups it is a member of, so after
any group that leaves some ranks out (a user's ``dist.new_group([0, 2])``, a comm hook's
leaders' group) the members count differently, compute two names for one group, and each
waits under its own until the timeout. ``among`` first evens the count out over the parent
group (one small all-gather; a rank that counts fewer joins that many one-rank groups of its
own), then makes the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..diagnose import fingerprints
from ..job.process_group import new_group


def among(ranks: list[int], parent: Any = None, **kwargs: Any) -> dist.ProcessGroup:
    """``dist.new_group(ranks, use_local_synchronization=True, **kwargs)`` (the job's timeout
    unless given), under a name every member computes alike. ``parent``: a group holding
    ``ranks`` whose every rank makes this call (None: the world).

    Sync point: every rank of ``parent``."""
    _even_out_names(parent)
    return new_group(ranks, use_local_synchronization=True, **kwargs)


def _count() -> int | None:
    """How many groups this process belongs to, as torch counts them to name one (None: a
    torch that keeps no such count)."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    return len(names) if names is not None else None


def _even_out_names(parent: Any) -> None:
    mine = _count()
    if mine is None:
        return
    group = parent if parent is not None else dist.group.WORLD
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)).lower():
        device = torch.device("cuda", torch.cuda.current_device())
    count = torch.tensor([mine], dtype=torch.int64, device=device)
    every = [torch.empty_like(count) for _ in range(group.size())]
    with fingerprints.collective("all_gather", count, label="group count", group=group):
        dist.all_gather(every, count, group=group)
    for _ in range(int(max(c.item() for c in every)) - mine):
        # A group of this rank alone: no one else meets, and it counts as one more group.
        new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
