"""torch's DistributedDataParallel API on rankwise's engine, against torch's DDP in the same ranks.

- ``register_comm_hook`` runs torch's own hooks unchanged (allreduce, fp16/bf16 compression,
  PowerSGD) and gives the parameters torch's DDP gives with the same hook;
- ``join()`` trains through uneven inputs (rank 1 has two more batches) like torch's;
- ``backward(create_graph=True)`` warns as torch does and gives torch's gradients;
- torch 2.13's constructor arguments are accepted (or refused naming the alternative).

One spawned world of 2 runs every case; the parent compares.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import rankwise as rw
from rankwise.testing import run_distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.module.parameters()]


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _train(model: nn.Module, batches: list, join: bool = False) -> list[np.ndarray]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join() if join else _null():
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return _params(model)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _hooks() -> dict:
    def power_sgd_state() -> psgd.PowerSGDState:
        # start_powerSGD_iter=2: two vanilla all-reduce steps, then rank-1 compression.
        return psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )

    return {
        "allreduce": (lambda: None, default_hooks.allreduce_hook),
        "fp16": (lambda: None, default_hooks.fp16_compress_hook),
        "bf16": (lambda: None, default_hooks.bf16_compress_hook),
        "powersgd": (power_sgd_state, psgd.powerSGD_hook),
    }


def _comm_hooks(rank: int) -> dict:
    out = {}
    batches = _batches(rank, 4)
    for name, (state, hook) in _hooks().items():
        ours = rw.DistributedDataParallel(_net())
        ours.register_comm_hook(state(), hook)
        result = {"ours": _train(ours, batches)}
        if name != "bf16":  # torch's register_comm_hook refuses bf16 without NCCL
            theirs = nn.parallel.DistributedDataParallel(_net())
            theirs.register_comm_hook(state(), hook)
            result["torch"] = _train(theirs, batches)
        out[name] = result
    out["plain"] = _train(rw.DistributedDataParallel(_net()), batches)
    return out


def _join(rank: int) -> dict:
    batches = _batches(rank, 3 + 2 * rank)  # rank 1 has two batches more
    ours = _train(rw.DistributedDataParallel(_net()), batches, join=True)
    theirs = _train(nn.parallel.DistributedDataParallel(_net()), batches, join=True)
    return {"ours": ours, "torch": theirs}


class _Scalar(nn.Module):
    """torch's test_ddp_create_graph model (its DDP fails with create_graph on an MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p.pow(2) * x.sum()


def _create_graph(rank: int) -> dict:
    x, _ = _batches(rank, 1)[0]
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = rw.DistributedDataParallel(_net())
        ours(x).pow(2).sum().backward(create_graph=True)
    out["warned"] = any("create_graph=True" in str(w.message) for w in caught)
    out["ours"] = [p.grad.detach().numpy().copy() for p in ours.module.parameters()]
    plain = _net()  # the mathematics: the average of every rank's own gradient
    plain(x).pow(2).sum().backward(create_graph=True)
    grads = [p.grad.detach().clone() for p in plain.parameters()]
    for g in grads:
        dist.all_reduce(g)
    out["oracle"] = [(g / dist.get_world_size()).numpy() for g in grads]
    for kind, cls in (("ours_scalar", rw.DistributedDataParallel), ("torch_scalar", nn.parallel.DistributedDataParallel)):
        model = cls(_Scalar())
        for _ in range(3):
            model(x).backward(create_graph=True)
        out[kind] = [model.module.p.grad.detach().numpy().copy()]
    return out


def _arguments(rank: int) -> dict:
    out = {}
    kwargs = {
        "dim": 0,
        "broadcast_buffers": None,
        "init_sync": True,
        "bucket_cap_mb": None,
        "gradient_as_bucket_view": True,
        "static_graph": True,
        "skip_all_reduce_unused_params": False,
        "batched_grad_copy": True,
        "forward_sync_buffers": True,
    }
    x, y = _batches(rank, 1)[0]
    model = rw.DistributedDataParallel(_net(), **kwargs)
    F.cross_entropy(model(x), y).backward()
    out["grad_is_view"] = all(
        p.grad.untyped_storage().data_ptr() == model.reducer._flat[0].untyped_storage().data_ptr()
        for p in model.module.parameters()
    )
    try:
        model._set_static_graph()
    except RuntimeError as exc:
        out["static_late"] = str(exc)
    try:
        rw.DistributedDataParallel(_net(), mixed_precision=object())
    except ValueError as exc:
        out["mixed"] = str(exc)
    return out


def _world() -> dict:
    rank = dist.get_rank()
    return {
        "hooks": _comm_hooks(rank),
        "join": _join(rank),
        "create_graph": _create_graph(rank),
        "arguments": _arguments(rank),
    }


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_distributed(_world, 2, timeout=240)


def _close(a: list, b: list, tol: float) -> bool:
    return all(np.allclose(x, y, rtol=0, atol=tol) for x, y in zip(a, b, strict=True))


def test_torch_comm_hooks_run_unchanged_and_match_torchs_ddp(world2):
    for res in world2:
        hooks = res["hooks"]
        for name in ("allreduce", "fp16", "powersgd"):
            assert _close(hooks[name]["ours"], hooks[name]["torch"], 1e-6), name
        assert _close(hooks["allreduce"]["ours"], hooks["plain"], 1e-6)
        assert _close(hooks["bf16"]["ours"], hooks["plain"], 2e-2)  # bf16: ~3 digits
        assert not _close(hooks["powersgd"]["ours"], hooks["plain"], 1e-6)  # it compressed
    for name in ("allreduce", "fp16", "bf16", "powersgd"):  # replicas identical
        assert _close(world2[0]["hooks"][name]["ours"], world2[1]["hooks"][name]["ours"], 0)


def test_join_trains_uneven_inputs_like_torch(world2):
    for res in world2:
        assert _close(res["join"]["ours"], res["join"]["torch"], 1e-6)
    assert _close(world2[0]["join"]["ours"], world2[1]["join"]["ours"], 0)


def test_create_graph_warns_and_gives_torchs_gradients(world2):
    for res in world2:
        cg = res["create_graph"]
        assert _close(cg["ours"], cg["oracle"], 1e-6)
        assert _close(cg["ours_scalar"], cg["torch_scalar"], 1e-6)
        assert cg["warned"]


def test_torch_arguments_are_accepted_or_refused_with_the_alternative(world2):
    for res in world2:
        args = res["arguments"]
        assert args["grad_is_view"]
        assert "should be called before training loop starts" in args["static_late"]
        assert "mixed_precision=" in args["mixed"] and "torch.autocast" in args["mixed"]
