"""Every process group rankwise makes waits as long as the job asked, not torch's 30 minutes.

torch's ``new_group`` defaults to 30 minutes whatever ``init_process_group`` was given: a group
made without a timeout outwaits the job's (a cut link under the hierarchical path hung 400 s
with ``rw.init(timeout=90)``). The oracle is torch's own record of each group: every group in
its group map (all of them, whoever made them) carries its backend's timeout; after building
each engine that makes groups (hierarchical DDP with shared memory, ZeRO stage 3 node-first, a
data x tensor mesh), every group must carry the job's.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.parallel.ddp.node import shared_reduce
from rankwise.parallel.ddp.node.hierarchical import HierarchicalBuckets
from rankwise.testing import run_distributed

JOB_TIMEOUT = 37.0  # no default of torch's or rankwise's: only the job's value gives it


def _timeouts() -> dict[str, float]:
    """Each group torch knows of (this rank a member) -> its backend's timeout in seconds."""
    out = {}
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        backend = pg._get_backend(torch.device("cpu"))
        name = dist.distributed_c10d._world.pg_names.get(pg, "?")
        out[f"{name} ({pg.size()} ranks)"] = backend.options._timeout.total_seconds()
    return out


def _as_two_nodes() -> int:
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2),
                      NNODES="2")  # fmt: skip
    rw.init("gloo", timeout=JOB_TIMEOUT)
    return rank


def _engines_across_nodes() -> dict:
    rank = _as_two_nodes()
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))  # 4 MiB: shared
    ddp = rw.DistributedDataParallel(big)
    g = torch.Generator().manual_seed(rank)
    F.cross_entropy(ddp(torch.randn(4, 1024, generator=g)), torch.tensor([0, 1, 2, 3])).backward()
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    zero = rw.ShardedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3,
                                  unit_numel=2000)  # fmt: skip
    F.cross_entropy(zero(torch.randn(4, 64, generator=g)), torch.tensor([0, 1, 2, 3])).backward()
    return {"groups": _timeouts(), "hier": isinstance(ddp.reducer.shared, HierarchicalBuckets)}


def _mesh_and_pipeline() -> dict:
    rw.init("gloo", timeout=JOB_TIMEOUT, mesh={"data": 2, "tensor": 2})
    return {"groups": _timeouts()}


def _assert_job_timeout(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert len(r["groups"]) > 1, r  # the world and the groups the engines made
        wrong = {name: t for name, t in r["groups"].items() if t != JOB_TIMEOUT}
        assert not wrong, f"rank {rank}: groups without the job's {JOB_TIMEOUT}s: {wrong}"


@pytest.mark.skipif(
    not os.path.isdir(shared_reduce.SHM_DIR)
    or shutil.disk_usage(shared_reduce.SHM_DIR).free < 64 * 2**20,
    reason=f"needs 64 MiB free in {shared_reduce.SHM_DIR}",
)
def test_hierarchical_and_zero3_groups_carry_the_jobs_timeout():
    results = run_distributed(_engines_across_nodes, 4, init=False, timeout=240)
    assert all(r["hier"] for r in results), "the hierarchical path was not taken"
    _assert_job_timeout(results)
    assert len(results[0]["groups"]) >= 5, results[0]  # world, intra, inter, barriers, gathers


def test_mesh_groups_carry_the_jobs_timeout():
    results = run_distributed(_mesh_and_pipeline, 4, init=False, timeout=180)
    _assert_job_timeout(results)


def _replicas_and_background_save(folder: str) -> dict:
    """The replicas' exchange group and the background saves' group (both Gloo, every rank)."""
    from torch.utils.data import DataLoader, TensorDataset

    rt = rw.init("gloo", timeout=JOB_TIMEOUT)
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    model, opt, loader = rt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    DataLoader(data, batch_size=2))  # fmt: skip
    reps = rt.replicas(model, opt, loader, every=1, folder=os.path.join(folder, "reps"))
    rt.save(os.path.join(folder, "ckpt"), model=model, optimizer=opt, step=1,
            background=True).wait()  # fmt: skip
    groups = _timeouts()
    reps.close()
    return {"groups": groups}


def test_replicas_and_background_save_groups_carry_the_jobs_timeout(tmp_path):
    results = run_distributed(_replicas_and_background_save, 2, args=(str(tmp_path),), init=False,
                              timeout=180)  # fmt: skip
    _assert_job_timeout(results)
    assert len(results[0]["groups"]) >= 3, results[0]  # world, replicas, background saves


def test_new_group_defaults_to_the_job_timeout_and_keeps_an_explicit_one():
    results = run_distributed(_explicit, 2, init=False, timeout=120)
    assert results == [[JOB_TIMEOUT, 5.0]] * 2


def _explicit() -> list[float]:
    from rankwise.job.process_group import new_group

    rw.init("gloo", timeout=timedelta(seconds=JOB_TIMEOUT))
    made = [new_group([0, 1]), new_group([0, 1], timeout=timedelta(seconds=5))]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in made]
