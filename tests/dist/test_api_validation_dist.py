"""Bad arguments that only a job can judge (world 2 on Gloo): mesh sizes against the world
size, ranks of the job, process groups, a backend this build lacks. Each must end in a
``rw.ConfigError`` on every rank, naming the argument and repeating the value, before any
collective (so no rank waits for another). tests/unit/test_api_validation.py has the rest.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.testing import run_distributed


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _data() -> TensorDataset:
    return TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


# (argument, its bad value as the message shows it, the call); before rw.init: init itself.
BEFORE_INIT = [
    ("mesh", "{'data': 3}", lambda: rw.init(backend="gloo", mesh={"data": 3})),
    ("mesh", "{'data': 2, 'tensor': 2}", lambda: rw.init(backend="gloo", mesh={"data": 2, "tensor": 2})),
    ("mesh", "{'tensor': 1}", lambda: rw.init(backend="gloo", mesh={"tensor": 1})),
    ("mesh", "[2]", lambda: rw.init(backend="gloo", mesh=[2])),
    ("strategy", "'single'", lambda: rw.init(backend="gloo", strategy="single")),
    ("backend", "'ncclx'", lambda: rw.init(backend="ncclx")),
    ("timeout", "0", lambda: rw.init(backend="gloo", timeout=0)),
    ("devices", "['cpu', 'cpu']", lambda: rw.init(backend="gloo", strategy="ddp", devices=["cpu", "cpu"])),
]  # fmt: skip

AFTER_INIT = [
    ("src", "2", lambda: rw.broadcast_object("x", src=2)),
    ("dst", "2", lambda: rw.gather_object("x", dst=2)),
    ("dst", "-1", lambda: rw.gather_object("x", dst=-1)),
    ("op", "'avg'", lambda: rw.all_reduce(1.0, op="avg")),
    ("timeout", "-1", lambda: rw.barrier(timeout=-1)),
    ("rank", "2", lambda: rw.DistributedSampler(_data(), rank=2)),
    ("rank", "2", lambda: rw.loader(_data(), batch_size=4, rank=2)),
    ("global_batch_size", "3", lambda: rw.loader(_data(), global_batch_size=3)),
    ("global_batch_size", "3", lambda: _prepare_ddp(global_batch_size=3)),
    ("process_group", "'gloo'", lambda: rw.DistributedDataParallel(_net(), process_group="gloo")),
    ("process_group", "3", lambda: _sharded(process_group=3)),
    ("ranks", "[0, 5]", lambda: rw.DistributedPipeline(_net(), ranks=[0, 5])),
    ("ranks", "5", lambda: rw.DistributedPipeline(_net(), ranks=5)),
    ("balance", "[1, 1]", lambda: rw.DistributedPipeline(_net(), balance=[1, 1])),
    ("chunks", "0", lambda: rw.DistributedPipeline(_net(), chunks=0)),
    ("device", "'tpu'", lambda: rw.DistributedPipeline(_net(), device="tpu")),
    ("loss_reduction", "'avg'", lambda: rw.DistributedPipeline(_net(), loss_reduction="avg")),
    ("mesh", "'pipeline'", lambda: rw.DistributedPipeline(_net(), mesh="pipeline")),
    ("data_parallel_group", "'data'", lambda: rw.DistributedPipeline(_net(), data_parallel_group="data")),
    ("group", "'tensor'", lambda: rw.tensor_parallel(_net(), {"0": "column"}, group="tensor")),
    ("out_features", "out_features=3", lambda: rw.ColumnParallelLinear(nn.Linear(4, 3))),
]  # fmt: skip


def _prepare_ddp(**kw):
    model = _net()
    return rw.init().prepare(model, _sgd(model), DataLoader(_data(), batch_size=4), **kw)


def _sharded(**kw):
    model = _net()
    return rw.ShardedDataParallel(model, _sgd(model), **kw)


def _outcome(name: str, shown: str, call) -> str:
    try:
        call()
    except rw.ConfigError as e:
        text = str(e)
        return "named" if name in text and shown in text else f"unnamed: {text}"
    except Exception as e:  # the census counts every other exception as raw
        return f"raw: {type(e).__name__}: {e}"
    return "accepted"


def _every_case() -> list[tuple[str, str]]:
    """Each rank tries every case in the same order; a refused one issues no collective."""
    seen = [(f"{n}={v}", _outcome(n, v, call)) for n, v, call in BEFORE_INIT]
    assert not rw.is_initialized()  # no refused init left a runtime (or a process group) behind
    rw.init(backend="gloo", strategy="ddp")
    seen += [(f"{n}={v}", _outcome(n, v, call)) for n, v, call in AFTER_INIT]
    rw.barrier()  # every rank got here: no case left a peer waiting in a collective
    return seen


def test_bad_arguments_in_a_job_are_config_errors_naming_them() -> None:
    results = run_distributed(_every_case, 2, init=False, timeout=240)
    bad = [f"rank {r} {case}: {how}" for r, seen in enumerate(results) for case, how in seen
           if how != "named"]  # fmt: skip
    print(f"\n{len(results[0])} bad inputs tried in a job of 2: {len(bad)} not named")
    assert not bad, "\n".join(bad)
    assert len(results[0]) == len(BEFORE_INIT) + len(AFTER_INIT) >= 25
