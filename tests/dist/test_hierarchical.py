"""Hierarchical collectives across nodes, on one host: the node boundaries come from the
launcher's environment (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), as on a cluster.

Four Gloo ranks on loopback play 2 nodes x 2 ranks; each "node" gets its own shared-memory
group. Against torch's DistributedDataParallel in the same ranks and the flat path:

- rankwise DDP picks the hierarchical path by itself, every replica is bit-identical, and the
  parameters match torch's DDP within float rounding (the sum runs node by node), in the usual
  loop orders, with ``join()`` (uneven inputs), two wrappers in one backward (one barrier
  queue), and a small bucket beside the shared one (the flat all-reduce);
- torch's communication hooks take precedence (no bucket goes through shared memory);
- ``hierarchical_reduce=True`` is refused with the reason: one node, uneven nodes,
  compression, ``shared_memory_reduce=False``, a node that cannot map its file (every rank
  then takes the flat path, never one node alone); nothing is left in /dev/shm;
- ZeRO stages 1-3 pick node-first collectives, and train as the flat ones do (AdamW with two
  parameter groups), the full state identical on every rank.
"""

from __future__ import annotations

import glob
import os
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import rankwise as rw
from rankwise.errors import ConfigError
from rankwise.parallel.ddp.node import shared_reduce, shm_file
from rankwise.parallel.ddp.node.hierarchical import HierarchicalBuckets
from rankwise.testing import run_distributed

pytestmark = pytest.mark.skipif(
    not os.path.isdir(shared_reduce.SHM_DIR)
    or shutil.disk_usage(shared_reduce.SHM_DIR).free < 256 * 2**20,
    reason=f"needs 256 MiB free in {shared_reduce.SHM_DIR} (docker run --shm-size=...)",
)

LEFTOVERS = os.path.join(shared_reduce.SHM_DIR, "rankwise-grads-*")
TIMEOUT = 300.0


def _join_as_nodes(sizes: tuple[int, ...]) -> int:
    """Set this rank's launcher variables for nodes of ``sizes`` ranks, then rw.init."""
    rank = int(os.environ["RANK"])
    starts = [sum(sizes[:n]) for n in range(len(sizes))]
    node = max(n for n, s in enumerate(starts) if s <= rank)
    os.environ.update(LOCAL_RANK=str(rank - starts[node]), LOCAL_WORLD_SIZE=str(sizes[node]),
                      GROUP_RANK=str(node), NNODES=str(len(sizes)))  # fmt: skip
    rw.init("gloo", timeout=TIMEOUT)
    return rank


def _net() -> nn.Module:
    """A 4 MiB weight (its own bucket: shared) and a small head (a flat Gloo bucket)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))


def _batches(rank: int, n: int, features: int = 1024) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, features, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]  # fmt: skip


def _params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.module.parameters()]


def _train(model: nn.Module, batches: list, to_none: bool = True) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=to_none)
    return _params(model)


def _hier(model: rw.DistributedDataParallel) -> bool:
    return isinstance(model.reducer.shared, HierarchicalBuckets)


def _refusal(make) -> str | None:
    try:
        make()
    except ConfigError as exc:
        return str(exc)
    return None


def _ddp_two_nodes() -> dict:
    rank = _join_as_nodes((2, 2))
    before = set(glob.glob(LEFTOVERS))
    out: dict = {}
    for to_none in (True, False):
        ours, theirs = rw.DistributedDataParallel(_net()), nn.parallel.DistributedDataParallel(_net())
        batches = _batches(rank, 3)
        out[f"train/{to_none}"] = {"ours": _train(ours, batches, to_none),
                                   "torch": _train(theirs, batches, to_none), "hier": _hier(ours)}  # fmt: skip
        out["node_group_size"] = ours.reducer.shared.world
        flat = rw.DistributedDataParallel(_net(), hierarchical_reduce=False, shared_memory_reduce=False)
        out[f"flat/{to_none}"] = _train(flat, batches, to_none)
    out["join"] = _join(rank)
    out["hook"] = _hook(rank)
    out["two_models"] = _two_models(rank)
    out["with_compression"] = _refusal(lambda: rw.DistributedDataParallel(
        _net(), compression="bf16", hierarchical_reduce=True))  # fmt: skip
    out["without_shm"] = _refusal(lambda: rw.DistributedDataParallel(
        _net(), shared_memory_reduce=False, hierarchical_reduce=True))  # fmt: skip
    out["node_without_room"] = _node_without_room(rank)
    dist.barrier()
    out["leftovers"] = sorted(set(glob.glob(LEFTOVERS)) - before)
    return out


def _node_without_room(rank: int) -> dict:
    """Node 1 cannot map its file: every rank takes the flat path (Gloo), none alone."""
    real_map = shm_file.map_file
    if rank >= 2:
        shm_file.map_file = lambda *args: None
    try:
        model = rw.DistributedDataParallel(_net())
        insisted = _refusal(lambda: rw.DistributedDataParallel(_net(), hierarchical_reduce=True))
    finally:
        shm_file.map_file = real_map
    return {"shared": model.reducer.shared is not None, "insisted": insisted}


def _join(rank: int) -> dict:
    batches = _batches(rank, 2 + rank % 3)  # ranks run out of batches at different steps
    results = {}
    for name, make in (("ours", rw.DistributedDataParallel),
                       ("torch", nn.parallel.DistributedDataParallel)):  # fmt: skip
        model = make(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for x, y in batches:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        results[name] = _params(model)
        if name == "ours":
            results["hier"] = _hier(model)
    return results


def _hook(rank: int) -> dict:
    ours, theirs = rw.DistributedDataParallel(_net()), nn.parallel.DistributedDataParallel(_net())
    for model in (ours, theirs):
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    batches = _batches(rank, 2)
    shared = [ours.reducer.shares(b) for b in range(len(ours.reducer.buckets))]
    return {"ours": _train(ours, batches), "torch": _train(theirs, batches),
            "through_shm": any(s is not None for s in shared)}  # fmt: skip


def _two_models(rank: int) -> dict:
    out = {}
    for name, make in (("ours", rw.DistributedDataParallel),
                       ("torch", nn.parallel.DistributedDataParallel)):  # fmt: skip
        torch.manual_seed(1)
        gen, critic = make(nn.Linear(256, 1024)), make(nn.Linear(1024, 1024))  # 1 MiB, 4 MiB
        opt = torch.optim.SGD([*gen.parameters(), *critic.parameters()], lr=0.1)
        for x, _ in _batches(rank, 3, features=256):
            opt.zero_grad()
            critic(torch.relu(gen(x))).pow(2).mean().backward()
            opt.step()
        out[name] = _params(gen) + _params(critic)
        if name == "ours":
            out["hier"] = _hier(gen) and _hier(critic)
    return out


def _close(a: list, b: list) -> bool:
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


def _same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_ddp_across_two_nodes_is_hierarchical_and_matches_torch():
    res = run_distributed(_ddp_two_nodes, 4, init=False, timeout=TIMEOUT)
    for r in res:
        assert r["node_group_size"] == 2  # each "node" its own shared-memory group
        for to_none in (True, False):
            case = r[f"train/{to_none}"]
            assert case["hier"]
            assert _close(case["ours"], case["torch"]) and _close(case["ours"], r[f"flat/{to_none}"])
            assert _same(case["ours"], res[0][f"train/{to_none}"]["ours"])  # bit-identical replicas
        assert r["join"]["hier"] and _close(r["join"]["ours"], r["join"]["torch"])
        assert _same(r["join"]["ours"], res[0]["join"]["ours"])
        assert not r["hook"]["through_shm"] and _close(r["hook"]["ours"], r["hook"]["torch"])
        assert r["two_models"]["hier"] and _close(r["two_models"]["ours"], r["two_models"]["torch"])
        assert "compression='bf16'" in r["with_compression"]
        assert "shared_memory_reduce=False" in r["without_shm"]
        assert not r["node_without_room"]["shared"]
        assert "a node could not map" in r["node_without_room"]["insisted"]
        assert r["leftovers"] == []


def _zero(stage: int, rank: int, hier: bool | None) -> tuple[list, bool]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.AdamW([{"params": net[0].parameters(), "lr": 1e-2},
                             {"params": net[2].parameters(), "lr": 3e-3, "weight_decay": 0.0}])  # fmt: skip
    model = rw.ShardedDataParallel(net, opt, stage=stage, unit_numel=2000, hierarchical_reduce=hier)
    for x, y in _batches(rank, 3, features=64):
        F.cross_entropy(model(x), y).backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
    state = model.state_dict()
    return [v.numpy().copy() for v in state.values()], model.units[0].lane is not None


def _zero_two_nodes() -> dict:
    rank = _join_as_nodes((2, 2))
    out = {}
    for stage in (1, 2, 3):
        ours, used = _zero(stage, rank, None)
        flat, flat_used = _zero(stage, rank, False)
        out[stage] = {"ours": ours, "flat": flat, "hier": used, "flat_hier": flat_used}
    out["gan"] = {hier: _zero_gan(rank, hier) for hier in (None, False)}
    out["wide"] = {hier: _zero_wide(rank, hier) for hier in (None, False)}
    return out


def _zero_wide(rank: int, hier: bool | None) -> dict:
    """Stage 3 with a unit over the 1 MiB shared-memory threshold (273k parameters)."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(64, 4200), nn.ReLU(), nn.Linear(4200, 4))
    model = rw.ShardedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3,
                                   unit_numel=2000, hierarchical_reduce=hier)  # fmt: skip
    for x, y in _batches(rank, 3, features=64):
        F.cross_entropy(model(x), y).backward()
        model.optimizer.step()
        model.optimizer.zero_grad()
    state = [v.numpy().copy() for v in model.state_dict().values()]
    unit = model.units[0]
    return {"state": state, "hier": unit.lane is not None, "shared": unit.node is not None}


def _zero_gan(rank: int, hier: bool | None) -> list:
    """Two stage-3 engines in one backward: their node-first collectives share one lane."""
    torch.manual_seed(1)
    gen, critic = nn.Linear(16, 64), nn.Linear(64, 64)
    engines = [rw.ShardedDataParallel(m, torch.optim.SGD(m.parameters(), lr=0.1), stage=3,
                                      hierarchical_reduce=hier) for m in (gen, critic)]  # fmt: skip
    for x, _ in _batches(rank, 3, features=16):
        engines[1](torch.relu(engines[0](x))).pow(2).mean().backward()
        for e in engines:
            e.optimizer.step()
            e.optimizer.zero_grad()
    return [v.numpy().copy() for e in engines for v in e.state_dict().values()]


def test_zero_stages_across_two_nodes_are_node_first_and_train_as_flat():
    res = run_distributed(_zero_two_nodes, 4, init=False, timeout=TIMEOUT)
    for r in res:
        for stage in (1, 2, 3):
            case = r[stage]
            assert case["hier"] and not case["flat_hier"], stage
            assert _close(case["ours"], case["flat"]), stage
            assert _same(case["ours"], res[0][stage]["ours"]), stage
        assert _close(r["gan"][None], r["gan"][False]) and _same(r["gan"][None], res[0]["gan"][None])
        # A unit over the shared-memory threshold: across nodes, node-first collectives and no
        # shared units; told flat, the ranks (here on one machine) share the units instead.
        wide = r["wide"]
        assert wide[None]["hier"] and not wide[None]["shared"]
        assert not wide[False]["hier"] and wide[False]["shared"]
        assert _close(wide[None]["state"], wide[False]["state"])
        assert _same(wide[None]["state"], res[0]["wide"][None]["state"])


def _uneven() -> dict:
    _join_as_nodes((2, 1))
    model = rw.DistributedDataParallel(_net())
    return {
        "kind": type(model.reducer.shared).__name__,
        "insisted": _refusal(lambda: rw.DistributedDataParallel(_net(), hierarchical_reduce=True)),
        "zero": _refusal(_zero_insisting),
    }


def _zero_insisting() -> None:
    net = _net()
    rw.ShardedDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), hierarchical_reduce=True)


def test_uneven_nodes_stay_flat_and_an_insistence_says_why():
    for r in run_distributed(_uneven, 3, init=False, timeout=TIMEOUT):
        assert r["kind"] != "HierarchicalBuckets"  # one host: the flat shared-memory path
        for text in (r["insisted"], r["zero"]):
            assert "hierarchical_reduce=True" in text and "[2, 1]" in text


def _one_node() -> dict:
    return {"ddp": _refusal(lambda: rw.DistributedDataParallel(_net(), hierarchical_reduce=True))}


def test_one_node_insisting_on_hierarchy_is_refused():
    for r in run_distributed(_one_node, 2, timeout=TIMEOUT):
        assert "one node" in r["ddp"]
