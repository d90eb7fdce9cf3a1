"""Groups rankwise makes among some ranks agree whatever groups the user made first.

torch names a group made by its members alone (``use_local_synchronization``, how rankwise
makes a node's groups, the node leaders' group and ZeRO-3's gather group) from its ranks and
the number of groups *this process* belongs to; a rank only joins the groups it is a member
of, so after a user's ``dist.new_group([0, 2])`` ranks 0 and 2 count one more than 1 and 3,
and a node group made next had two names on its two ranks: each waited for the other under
its own name until the timeout (what hung the slow-link benchmark, whose torch comm hook makes
a leaders' group first). Every case below first makes a group that only some ranks join, then
builds the engine that makes groups, takes a step, and checks the replicas agree.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.parallel.ddp.node import shared_reduce
from rankwise.parallel.ddp.node.hierarchical import HierarchicalBuckets
from rankwise.testing import run_distributed

PARTIAL = ([0, 2], [1], [0, 1, 2])
"""Groups of the 4-rank world that leave some ranks out (the user's, made first)."""


def _as_two_nodes() -> int:
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2),
                      NNODES="2")  # fmt: skip
    rw.init("gloo", timeout=20)
    return rank


def _step_and_digest(model: nn.Module, features: int, rank: int) -> list[float]:
    g = torch.Generator().manual_seed(rank)
    F.cross_entropy(
        model(torch.randn(4, features, generator=g)), torch.tensor([0, 1, 2, 3])
    ).backward()
    return [p.grad.double().sum().item() for p in model.parameters() if p.grad is not None]


def _engines_after_partial_groups(engine: str) -> list[dict]:
    """For each group of ``PARTIAL`` in turn: make it, then build ``engine`` afresh (its own
    groups) and take a step. The counts drift further apart with each partial group."""
    rank = _as_two_nodes()
    out = []
    for partial in PARTIAL:
        dist.new_group(partial)  # every rank calls it; only the members join
        torch.manual_seed(0)
        if engine == "hierarchical_ddp":
            net = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))
            model = rw.DistributedDataParallel(net)
            made = isinstance(model.reducer.shared, HierarchicalBuckets)
            out.append({"grads": _step_and_digest(model, 1024, rank), "made_groups": made})
            continue
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
        model = rw.ShardedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3,
                                       unit_numel=2000)  # fmt: skip
        made = model.units[0].gather_group is not None
        out.append({"grads": _step_and_digest(model, 64, rank), "made_groups": made})
    return out


@pytest.mark.skipif(
    not os.path.isdir(shared_reduce.SHM_DIR)
    or shutil.disk_usage(shared_reduce.SHM_DIR).free < 64 * 2**20,
    reason=f"needs 64 MiB free in {shared_reduce.SHM_DIR}",
)
@pytest.mark.parametrize("engine", ["hierarchical_ddp", "zero3"])
def test_groups_made_among_members_agree_after_groups_some_ranks_skip(engine):
    results = run_distributed(_engines_after_partial_groups, 4, args=(engine,), init=False,
                              timeout=150)  # fmt: skip
    for k, partial in enumerate(PARTIAL):
        rows = [r[k] for r in results]
        assert all(r["made_groups"] for r in rows), (partial, rows)
        assert all(r["grads"] == rows[0]["grads"] for r in rows), (partial, rows)
