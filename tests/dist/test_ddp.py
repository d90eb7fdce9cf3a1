"""rankwise.DistributedDataParallel against two oracles, on real gloo process groups.

1. A single process trained on the concatenation of every rank's batches (the mathematics):
   after 20 SGD/Adam steps the parameters agree to 1e-6.
2. torch's own DistributedDataParallel, run in the same ranks on the same inputs.

Several cases share one spawned run to keep the suite fast.
"""

from __future__ import annotations

import contextlib

import ddp_cases as dc
import pytest
import torch
import torch.nn.functional as F

import rankwise as rw
from rankwise.testing import run_distributed

TOL = 1e-6


def _params(model: torch.nn.Module) -> dict:
    # numpy, not tensors: run_distributed's queue would pass tensors as shared-memory handles
    # that die with the rank that sent them.
    inner = getattr(model, "module", model)
    return {k: v.detach().cpu().numpy().copy() for k, v in inner.state_dict().items()}


def _tensors(arrays: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _on(model: torch.nn.Module, device: str) -> torch.nn.Module:
    return model if isinstance(model, dc.Span) else model.to(device)  # Span places itself


def _train_cases(names: list[str], device: str = "cpu") -> dict:
    rt = rw.get_runtime()
    out = {}
    for name in names:
        case = dc.CASES[name]
        torch.manual_seed(1000 + rt.rank)  # different on every rank: the broadcast must fix it
        ours = rw.DistributedDataParallel(
            _on(dc.build(case.build), device), find_unused_parameters=case.find_unused
        )
        dc.train_replica(case, ours, rt.world_size, rt.rank)
        result = {"ours": _params(ours)}
        if case.build == "branchy":
            result["never_grad_is_none"] = ours.module.never.weight.grad is None
        if case.torch_too:
            torch.manual_seed(1000 + rt.rank)
            theirs = torch.nn.parallel.DistributedDataParallel(
                _on(dc.build(case.build), device), find_unused_parameters=case.find_unused
            )
            dc.train_replica(case, theirs, rt.world_size, rt.rank)
            result["torch"] = _params(theirs)
        out[name] = result
    return out


def _check(results: list[dict], names: list[str], world: int, device: str = "cpu") -> None:
    for name in names:
        case = dc.CASES[name]
        ours = [_tensors(r[name]["ours"]) for r in results]
        for rank in range(1, world):  # replicas stay identical (BatchNorm's running statistics
            # are each rank's own after its last forward, as in torch, so they are not compared)
            same = [k for k in ours[0] if "running_" not in k]
            assert all(torch.equal(ours[0][k], ours[rank][k]) for k in same), (name, rank)
        if case.build != "cnn_bn":  # BatchNorm uses per-rank batch statistics: no 1-process twin
            trained = dc.train_oracle(case, world, device)
            oracle = {k: v.detach().cpu() for k, v in trained.state_dict().items()}
            assert dc.max_diff(ours[0], oracle) <= TOL, (name, dc.max_diff(ours[0], oracle))
            torch.manual_seed(1000)
            initial = {k: v.cpu() for k, v in dc.build(case.build).state_dict().items()}
            assert dc.max_diff(ours[0], initial) > 1e-3, name  # it did train
        if case.torch_too:
            diff = dc.max_diff(ours[0], _tensors(results[0][name]["torch"]))
            assert diff <= TOL, (name, diff)
        if case.build == "branchy":
            assert all(r[name]["never_grad_is_none"] for r in results)
            torch.manual_seed(1000)
            never = dc.build("branchy").never.weight.detach()
            assert torch.equal(ours[0]["never.weight"], never)


ALL = [name for name in dc.CASES if name != "span"]


def _world2() -> dict:
    # One spawned run for every world-2 check: starting processes is the expensive part.
    return {
        "cases": _train_cases(ALL),
        "grads": _local_grads_then_compressed(),
        "errors": _error_messages(),
    }


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_distributed(_world2, 2, timeout=240)


def test_world2_every_case_matches_single_process_and_torch(world2):
    _check([r["cases"] for r in world2], ALL, 2)


@pytest.mark.parametrize(
    ("world", "names"),
    [(3, ["mlp_sgd", "branchy", "accum_no_sync_backward"]), (4, ["cnn_adam", "tied"])],
)
def test_larger_worlds_match_single_process_and_torch(world, names):
    results = run_distributed(_train_cases, world, args=(names,), timeout=180)
    _check(results, names, world)


# -- no_sync really skips communication; compression really compresses -----------------------


def _local_grads_then_compressed() -> dict:
    rt = rw.get_runtime()
    case = dc.CASES["mlp_sgd"]
    x, y = dc.data(case, rt.world_size)
    torch.manual_seed(1000)
    model = rw.DistributedDataParallel(dc.build("mlp"))
    out = {}
    for label, ctx in (("no_sync", model.no_sync()), ("plain", contextlib.nullcontext())):
        loss = F.cross_entropy(model(x[0, rt.rank, 0]), y[0, rt.rank, 0])
        with ctx:  # only around backward: still skipped
            loss.backward()
        out[label] = model.module[0].weight.grad.numpy().copy()
        model.zero_grad()
    torch.manual_seed(1000)
    bf16 = rw.DistributedDataParallel(dc.build("mlp"), compression="bf16")
    F.cross_entropy(bf16(x[0, rt.rank, 0]), y[0, rt.rank, 0]).backward()
    out["bf16"] = bf16.module[0].weight.grad.numpy().copy()
    return out


def test_no_sync_around_backward_keeps_local_gradients_and_bf16_sums_halves(world2):
    results = [_tensors(r["grads"]) for r in world2]
    case = dc.CASES["mlp_sgd"]
    x, y = dc.data(case, 2)
    local = []
    for r in range(2):
        torch.manual_seed(1000)
        model = dc.build("mlp")
        F.cross_entropy(model(x[0, r, 0]), y[0, r, 0]).backward()
        local.append(model[0].weight.grad)
    for r in range(2):  # inside no_sync: this rank's own gradient, not the average
        torch.testing.assert_close(results[r]["no_sync"], local[r], rtol=0, atol=1e-7)
    mean = (local[0] + local[1]) / 2
    for r in range(2):
        torch.testing.assert_close(results[r]["plain"], mean, rtol=0, atol=1e-7)
    # bf16 on the wire: each rank's half rounded to bf16, summed in bf16, back in fp32.
    wire = ((local[0] / 2).bfloat16() + (local[1] / 2).bfloat16()).float()
    assert results[0]["bf16"].dtype == torch.float32
    torch.testing.assert_close(results[0]["bf16"], wire, rtol=2**-7, atol=1e-6)
    assert not torch.equal(results[0]["bf16"], mean)
    assert torch.equal(results[0]["bf16"], results[1]["bf16"])


# -- errors that name what is wrong ---------------------------------------------------------


def _error_messages() -> dict:
    rt = rw.get_runtime()
    out = {}
    width = 4 if rt.rank == 0 else 5
    try:
        rw.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, width)))
    except rw.DistributedError as exc:
        out["mismatch"] = str(exc)
    model = rw.DistributedDataParallel(dc.Branchy())
    try:
        model(torch.randn(2, 8)).sum().backward()
    except rw.ConfigError as exc:
        out["unused"] = str(exc)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    net[0].requires_grad_(False)
    model = rw.DistributedDataParallel(net)
    model(torch.randn(2, 8)).sum().backward()  # frozen as when wrapped: trains
    net[0].requires_grad_(True)
    with torch.no_grad():
        model(torch.randn(2, 8))  # an evaluation builds no gradient: allowed
    try:
        model(torch.randn(2, 8))
        out["unfrozen"] = "no error"
    except rw.ConfigError as exc:
        out["unfrozen"] = str(exc)
    return out


def test_mismatched_models_unused_and_unfrozen_parameters_are_named(world2):
    for rank, res in enumerate(r["errors"] for r in world2):
        assert res["mismatch"].startswith(f"[rank {rank}] the model differs across ranks: ")
        assert "parameter '0.weight' of shape [4, 8] float32 on rank 0" in res["mismatch"]
        assert "[5, 8] float32 on rank 1" in res["mismatch"]
        assert "Fix: build the same model" in res["mismatch"]
        assert (
            "2 of 8 parameters got no gradient in this backward pass: never.weight, "
            in (res["unused"])
        )
        assert "never.bias." in res["unused"]
        assert "Fix: set find_unused_parameters=True" in res["unused"]
        # unfrozen after wrapping: its gradient has no bucket, each rank would train its own
        assert res["unfrozen"].startswith(f"[rank {rank}] 2 parameter(s) had requires_grad=False")
        assert "0.weight, 0.bias" in res["unfrozen"]
        assert "Fix: set requires_grad before wrapping" in res["unfrozen"]


# -- GPU: the same engine on CUDA tensors (gloo carries them) -------------------------------


GPU_CASES = ["mlp_adam", "tied", "span"]


def _cuda_case() -> dict:
    rw.init("gloo", device="cuda:0")  # both ranks share the one GPU a test machine may have
    return _train_cases(GPU_CASES, device="cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cpu_spanning_modules_match_single_process_and_torch():
    results = run_distributed(_cuda_case, 2, timeout=180, init=False)
    _check(results, GPU_CASES, 2, device="cuda:0")
