"""Ranks on one machine over Gloo average large buckets through shared memory (docs/ddp.md).

Against torch's DistributedDataParallel in the same ranks:

- every usual loop order gives torch's parameters bit for bit at world size 2 (a sum of two is
  order-free), and ``.grad`` is this rank's slot of the shared file;
- a rank that sums late holds the others at the end of backward: none steps, clips or zeroes
  its ``.grad`` before every sum is in its slot;
- at world size 3 the replicas stay bit-identical (each chunk is summed once, then copied);
- uneven inputs (``join()``) and torch's communication hooks work over shared buckets;
- a rank that cannot map the file makes every rank fall back to Gloo's all-reduce (one rank
  alone must never switch), and ``shared_memory_reduce=True`` then says why and how to fix it;
- two wrappers in one backward (a GAN) share one barrier queue without deadlock;
- nothing is left in /dev/shm, and a rank that dies mid-run fails its peer instead of hanging;
  one that stalls is named, with where it is, by the diagnosis of the shared bucket's barrier.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import LOOP_ORDERS, backward_in_order
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import rankwise as rw
from rankwise.diagnose import fingerprints
from rankwise.errors import ConfigError, DistributedError
from rankwise.parallel.ddp.node import shared_reduce, shm_file
from rankwise.testing import run_distributed

pytestmark = pytest.mark.skipif(
    not os.path.isdir(shared_reduce.SHM_DIR)
    or shutil.disk_usage(shared_reduce.SHM_DIR).free < 256 * 2**20,
    reason=f"needs 256 MiB free in {shared_reduce.SHM_DIR} (docker run --shm-size=...)",
)

LEFTOVERS = os.path.join(shared_reduce.SHM_DIR, "rankwise-grads-*")


def _net() -> nn.Module:
    """A 4 MiB first weight: its bucket is large enough to be shared."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(rank: int, n: int, features: int = 1024) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(8, features, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(n)
    ]


def _params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.module.parameters()]


def _train(model: nn.Module, batches: list, order: str = "last", to_none: bool = True) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        backward_in_order(model, opt, x, y, order, to_none)
        opt.step()
        if order == "last":
            opt.zero_grad(set_to_none=to_none)
    return _params(model)


def _aliases_slot(model: rw.DistributedDataParallel) -> bool:
    """Every gradient of a shared bucket is a view of this rank's slot of the shared file."""
    reducer, shared = model.reducer, model.reducer.shared
    held = [b for b in range(len(reducer.buckets)) if shared.holds(b)]
    for b in held:
        flat = shared.flat(b)
        for i in reducer.buckets[b].indices:
            g = reducer.params[i].grad
            if g.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                return False
    return bool(held)


def _orders(rank: int) -> dict:
    out = {}
    for order, to_none in LOOP_ORDERS:
        ours = rw.DistributedDataParallel(_net())
        theirs = nn.parallel.DistributedDataParallel(_net())
        batches = _batches(rank, 3)
        out[f"{order}/{to_none}"] = {
            "ours": _train(ours, batches, order, to_none),
            "torch": _train(theirs, batches, order, to_none),
            "shared": ours.reducer.shared is not None,
        }
        # gradients of the last step (.grad survives zero_grad(set_to_none=False) and 'first')
        if order != "last" or not to_none:
            out[f"{order}/{to_none}"]["aliases"] = _aliases_slot(ours)
    return out


def _join(rank: int) -> dict:
    shared_reduce.MIN_BYTES = 0  # every bucket shared, even the small net's
    try:
        batches = _batches(rank, 3 + 2 * rank, features=6)  # rank 1 has two batches more
        results = {}
        for name, make in (("ours", rw.DistributedDataParallel), ("torch", _torch_ddp)):
            model = make(_small())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with model.join():
                for x, y in batches:
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            results[name] = _params(model)
            if name == "ours":
                results["shared"] = model.reducer.shared is not None
        return results
    finally:
        shared_reduce.MIN_BYTES = 1024 * 1024


def _torch_ddp(module: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module)


def _hooks(rank: int) -> dict:
    out = {}
    for name, hook in (
        ("allreduce", default_hooks.allreduce_hook),
        ("fp16", default_hooks.fp16_compress_hook),
    ):
        ours, theirs = rw.DistributedDataParallel(_net()), _torch_ddp(_net())
        ours.register_comm_hook(None, hook)
        theirs.register_comm_hook(None, hook)
        batches = _batches(rank, 2)
        out[name] = {"ours": _train(ours, batches), "torch": _train(theirs, batches)}
        out[name]["shared"] = ours.reducer.shared is not None
    return out


def _fallback(rank: int) -> dict:
    before = set(glob.glob(LEFTOVERS))
    real_map = shm_file.map_file
    if rank == 1:  # as if rank 1 ran on another machine: rank 0's file is not there
        shm_file.map_file = lambda *args: None
    try:
        model = rw.DistributedDataParallel(_net())
        out = {"shared": model.reducer.shared is not None}
        theirs = _torch_ddp(_net())
        batches = _batches(rank, 2)
        out["ours"], out["torch"] = _train(model, batches), _train(theirs, batches)
        try:
            rw.DistributedDataParallel(_net(), shared_memory_reduce=True)
            out["insisted"] = None
        except ConfigError as exc:
            out["insisted"] = str(exc)
        try:
            rw.DistributedDataParallel(_small(), compression="bf16", shared_memory_reduce=True)
            out["with_compression"] = None
        except ConfigError as exc:
            out["with_compression"] = str(exc)
    finally:
        shm_file.map_file = real_map
    dist.barrier()
    out["leftovers"] = sorted(set(glob.glob(LEFTOVERS)) - before)
    return out


def _two_models(rank: int) -> dict:
    """Two wrappers in one backward (a GAN's generator and critic): one barrier queue serves
    both, so their buckets interleave; still torch's parameters, and no deadlock."""
    out = {}
    for name, make in (("ours", rw.DistributedDataParallel), ("torch", _torch_ddp)):
        torch.manual_seed(1)
        gen, critic = make(nn.Linear(256, 1024)), make(nn.Linear(1024, 1024))  # 1 MiB, 4 MiB
        opt = torch.optim.SGD([*gen.parameters(), *critic.parameters()], lr=0.1)
        for x, _ in _batches(rank, 3, features=256):
            opt.zero_grad()
            critic(torch.relu(gen(x))).pow(2).mean().backward()
            opt.step()
        out[name] = _params(gen) + _params(critic)
        if name == "ours":
            out["shared"] = gen.reducer.shared is not None and critic.reducer.shared is not None
    return out


def _slow_sums(rank: int) -> dict:
    """Rank 0 sums and copies out its chunks late: rank 1 reaches the end of backward first
    and, unless the last barrier holds it, steps (or clips, or zeroes .grad in place) with
    chunks rank 0 has not written into its slot yet, or has them overwritten."""
    real = shared_reduce.SharedBuckets._reduce

    def late(self, b: int) -> None:
        time.sleep(0.2)
        real(self, b)

    if rank == 0:
        shared_reduce.SharedBuckets._reduce = late
    out = {}
    try:
        for order, to_none, clip in (("first", False, False), ("last", False, True)):
            results = {}
            for name, make in (("ours", rw.DistributedDataParallel), ("torch", _torch_ddp)):
                model = make(_net())
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                for x, y in _batches(rank, 3):
                    backward_in_order(model, opt, x, y, order, to_none)
                    if clip:  # in place on .grad, the slot: a clipping that clips
                        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                        results.setdefault(f"{name}_norms", []).append(norm.item())
                    opt.step()
                    if order == "last":
                        opt.zero_grad(set_to_none=to_none)
                results[name] = _params(model)
                if name == "ours":
                    results["shared"] = model.reducer.shared is not None
            out[f"{order}/{to_none}/clip={clip}"] = results
    finally:
        shared_reduce.SharedBuckets._reduce = real
    return out


def _world2() -> dict:
    rank = dist.get_rank()
    return {
        "slow_sums": _slow_sums(rank),
        "orders": _orders(rank),
        "join": _join(rank),
        "hooks": _hooks(rank),
        "fallback": _fallback(rank),
        "two_models": _two_models(rank),
    }


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_distributed(_world2, 2, timeout=240)


def _equal(a: list, b: list, tol: float = 0.0) -> bool:
    return all(np.allclose(x, y, rtol=0, atol=tol) for x, y in zip(a, b, strict=True))


def _shared_like_torch(world2: list[dict], part: str):
    """(rank, case, result) of every case of ``part``, once its bucket was shared and its
    parameters equal torch's bit for bit."""
    for rank, res in enumerate(world2):
        for case, r in res[part].items():
            assert r["shared"], f"rank {rank}, {case}: the 4 MiB bucket was not shared"
            assert _equal(r["ours"], r["torch"]), f"rank {rank}, {case}: differs from torch"
            yield rank, case, r


def test_every_loop_order_gives_torchs_parameters_bit_for_bit(world2):
    for rank, order, r in _shared_like_torch(world2, "orders"):
        if "aliases" in r:
            assert r["aliases"], f"rank {rank}, {order}: .grad is not the shared slot"


def test_a_late_ranks_sums_reach_every_slot_before_anyone_uses_or_writes_it(world2):
    for rank, _, r in _shared_like_torch(world2, "slow_sums"):
        if "ours_norms" in r:
            assert min(r["ours_norms"]) > 1e-3, "the clipping did not clip"
            assert r["ours_norms"] == r["torch_norms"], f"rank {rank}: norms differ"


def test_join_over_shared_buckets_trains_like_torch(world2):
    for res in world2:
        assert res["join"]["shared"]
        assert _equal(res["join"]["ours"], res["join"]["torch"], 1e-6)
    assert _equal(world2[0]["join"]["ours"], world2[1]["join"]["ours"])


def test_torch_comm_hooks_run_over_shared_buckets(world2):
    for res in world2:
        for name, r in res["hooks"].items():
            assert r["shared"], name
            assert _equal(r["ours"], r["torch"], 1e-6), name


def test_one_rank_that_cannot_map_makes_every_rank_fall_back(world2):
    for rank, res in enumerate(world2):
        fb = res["fallback"]
        assert not fb["shared"], f"rank {rank} used shared memory alone"
        assert _equal(fb["ours"], fb["torch"])
        assert "shared_memory_reduce=True" in fb["insisted"]
        assert shared_reduce.SHM_DIR in fb["insisted"] and "--shm-size" in fb["insisted"]
        assert fb["leftovers"] == [], "a shared-memory file was left behind"
        assert "compression='bf16'" in fb["with_compression"]


def test_two_wrappers_in_one_backward_share_the_queue_without_deadlock(world2):
    for res in world2:
        assert res["two_models"]["shared"]
        assert _equal(res["two_models"]["ours"], res["two_models"]["torch"])


def _many() -> dict:
    rank = dist.get_rank()
    model = rw.DistributedDataParallel(_net())
    ours = _train(model, _batches(rank, 3), order="after_forward")
    theirs = _train(_torch_ddp(_net()), _batches(rank, 3), order="after_forward")
    return {"ours": ours, "torch": theirs, "shared": model.reducer.shared is not None}


@pytest.mark.parametrize("world", [3, 4])  # the barriers take 2 rounds: W not and W a power of 2
def test_replicas_stay_bit_identical_and_match_torch(world):
    res = run_distributed(_many, world, timeout=180)
    for r in res:
        assert r["shared"]
        assert _equal(r["ours"], r["torch"], 1e-6)  # Gloo's ring sums in another order
        assert _equal(r["ours"], res[0]["ours"]), "replicas differ"


def _dies() -> str:
    rank = dist.get_rank()
    model = rw.DistributedDataParallel(_net())
    x, y = _batches(rank, 1)[0]
    if rank == 1:
        os._exit(3)  # killed between construction and the first backward
    try:
        F.cross_entropy(model(x), y).backward()
    except DistributedError as exc:
        return f"DistributedError: {exc}"
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "no error"


def test_a_dead_peer_fails_the_backward_instead_of_hanging():
    with pytest.raises(DistributedError) as info:
        run_distributed(_dies, 2, timeout=90)
    report = str(info.value)
    assert "rank 1" in report and "code 3" in report
    # rank 0 reported an error of its own (it did not hang until the harness's timeout)
    assert "timed out" not in report.lower()


def _stalls() -> None:
    rw.init("gloo", timeout=5.0)  # the barriers take the group's timeout
    fingerprints.configure(checks=False)  # no pre-flight check: the barrier itself times out
    shared_reduce.MIN_BYTES = 0  # bucket 0 (the last layer's, 16 KiB) is shared too
    rank = dist.get_rank()
    model = rw.DistributedDataParallel(_net())
    assert model.reducer.shares(0) is not None
    x, y = _batches(rank, 1)[0]
    if rank == 1:
        time.sleep(3600)  # stall-site
    F.cross_entropy(model(x), y).backward()


def test_a_stalled_peer_is_named_by_the_diagnosis_of_the_shared_bucket():
    with pytest.raises(DistributedError) as info:
        run_distributed(_stalls, 2, init=False, timeout=90)
    text = str(info.value)
    # (its number counts construction's collectives, the node all-gather of ddp/hierarchical too)
    assert re.search(r"waiting in all_reduce #\d+ \(gradient bucket 0", text) and "timed out" in text
    with open(__file__) as f:
        line = next(n for n, t in enumerate(f, 1) if t.rstrip().endswith("# stall-site"))
    assert f"is running user code at {os.path.basename(__file__)}:{line}" in text  # rank 1

