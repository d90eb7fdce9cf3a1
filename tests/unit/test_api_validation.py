"""Every public entry point refuses a wrong argument with a ``ConfigError`` that names it.

The bad inputs are generated (tests/unit/api_cases.py) from each entry point's signature plus
``EXTRA``, a table of the values an annotation cannot tell (zero and negative sizes, unknown
names, wrong device strings). Each case must end in a ``rw.ConfigError`` (a ``ValueError``)
whose message names the argument and repeats the value; ``test_census`` runs them all and
prints the count. What needs a process group (mesh sizes against the world size, ranks of the
job, process groups) is in tests/dist/test_api_validation_dist.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import api_cases as ac
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.session import Session


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _data(n: int = 16) -> TensorDataset:
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _trained() -> tuple[Session, nn.Module]:
    """A session and a model with gradients, for the loop verbs."""
    rt = rw.init(strategy="single")
    model = _net()
    model(torch.randn(2, 4)).sum().backward()
    return rt, model


MAKE = {"module": lambda: nn.Linear(2, 2)}


# ---- builders: the entry point with valid arguments and **kw replacing one ----


def _init(tmp: Path, **kw):
    return rw.init(**kw)


def _prepare(tmp: Path, **kw):
    rt = rw.init(strategy="single")
    model = _net()
    args = {"model": model, "optimizer": _sgd(model), "loader": DataLoader(_data(), batch_size=4)}
    return rt.prepare(**{**args, **kw})


def _prepare_loader(tmp: Path, **kw):
    rt = rw.init(strategy="single")
    return rt.prepare_loader(**{"loader": DataLoader(_data(), batch_size=4), **kw})


def _save(tmp: Path, **kw):
    model = _net()
    args = {"path": tmp / "ckpt", "model": model, "optimizer": _sgd(model), "step": 1}
    return rw.init(strategy="single").save(**{**args, **kw})


def _saved(tmp: Path) -> Path:
    return rw.save_checkpoint(tmp / "saved", model=_net(), step=1)


def _load(tmp: Path, **kw):
    path = _saved(tmp)
    return rw.init(strategy="single").load(**{"path": path, "model": _net(), **kw})


def _save_checkpoint(tmp: Path, **kw):
    model = _net()
    args = {"path": tmp / "ckpt", "model": model, "optimizer": _sgd(model), "step": 1}
    return rw.save_checkpoint(**{**args, **kw})


def _load_checkpoint(tmp: Path, **kw):
    return rw.load_checkpoint(**{"path": _saved(tmp), "model": _net(), **kw})


def _list_checkpoints(tmp: Path, **kw):
    return rw.list_checkpoints(**{"directory": tmp, **kw})


def _backward(tmp: Path, **kw):
    rt = rw.init(strategy="single")
    return rt.backward(**{"loss": _net()(torch.randn(2, 4)).sum(), **kw})


def _clip_norm(tmp: Path, **kw):
    rt, model = _trained()
    return rt.clip_grad_norm_(**{"model": model, "max_norm": 1.0, **kw})


def _clip_value(tmp: Path, **kw):
    rt, model = _trained()
    return rt.clip_grad_value_(**{"model": model, "clip_value": 1.0, **kw})


def _accumulate(tmp: Path, **kw):
    rt = rw.init(strategy="single")
    with rt.accumulate(**{"model": _net(), "steps": 2, **kw}):
        pass


def _no_backward_sync(tmp: Path, **kw):
    rt = rw.init(strategy="single")
    with rt.no_backward_sync(**{"model": _net(), **kw}):
        pass


def _full_parameters(tmp: Path, **kw):
    rt = rw.init(strategy="single")
    with rt.full_parameters(**{"model": _net(), **kw}):
        pass


def _log(tmp: Path, **kw):
    rt = rw.init(strategy="single")
    rt.log_to(tmp / "logs", tensorboard=False)
    return rt.log(**{"metrics": {"loss": 0.5}, "step": 0, **kw})


def _log_to(tmp: Path, **kw):
    return rw.init(strategy="single").log_to(**{"log_dir": tmp / "logs", "tensorboard": False, **kw})


def _loader(tmp: Path, **kw):
    size = {} if "global_batch_size" in kw else {"batch_size": 4}
    return rw.loader(**{"dataset": _data(), **size, **kw})


def _sampler(tmp: Path, **kw):
    return list(rw.DistributedSampler(**{"dataset": _data(), "num_replicas": 2, "rank": 0, **kw}))


def _sharded_iterable(tmp: Path, **kw):
    args = {"dataset": list(range(8)), "num_replicas": 2, "rank": 0}
    return list(rw.ShardedIterable(**{**args, **kw}))


def _batch_loader(tmp: Path, **kw):
    args = {"dataloader": DataLoader(_data(), batch_size=4), "per_device_batch_size": 4}
    return rw.Loader(**{**args, "num_replicas": 1, "replicas_in_process": 1, **kw})


def _device_mesh(tmp: Path, **kw):
    return rw.DeviceMesh(**{"sizes": {"data": 2}, "rank": 0, **kw})


def _init_mesh(tmp: Path, **kw):
    return rw.init_mesh(**{"sizes": {"data": 1}, **kw})


def _topology(tmp: Path, **kw):
    return rw.Topology(**{"nnodes": 2, "nproc_per_node": 2, **kw})


def _dist_env(tmp: Path, **kw):
    return rw.DistEnv(**kw)


def _progress(tmp: Path, **kw):
    return list(rw.progress(**{"iterable": [1, 2, 3], **kw}))


def _join(tmp: Path, **kw):
    with rw.join(**{"iterable": [1, 2], **kw}) as batches:
        return list(batches)


def _gather_for_metrics(tmp: Path, **kw):
    return rw.gather_for_metrics(**{"data": torch.arange(4), **kw})


def _comm(fn):
    def build(tmp: Path, **kw):
        return fn(**kw) if "value" in kw or "obj" in kw or fn is rw.barrier else fn(1.0, **kw)

    return build


def _launch(tmp: Path, **kw):
    return rw.launch(**{"fn": print, "nprocs": 1, "timeout": 60, **kw})


def _get_logger(tmp: Path, **kw):
    return rw.get_logger(**{"name": "rankwise.test_api_validation", **kw})


def _unwrap(tmp: Path, **kw):
    return rw.unwrap_model(**kw)


def _data_parallel(tmp: Path, **kw):
    return rw.DataParallel(**{"module": _net(), "device_ids": ["cpu", "cpu"], **kw})


def _ddp(tmp: Path, **kw):
    return rw.DistributedDataParallel(**{"module": _net(), **kw})


def _sharded(tmp: Path, **kw):
    model = _net()
    return rw.ShardedDataParallel(**{"module": model, "optimizer": _sgd(model), **kw})


def _split(tmp: Path, **kw):
    return rw.split(**{"model": _net(), "devices": ["cpu", "cpu"], **kw})


def _pipe(tmp: Path, **kw):
    layers = list(_net().named_children())
    args = {"layers": layers, "devices": [torch.device("cpu")] * 2, "balance": [2, 1]}
    return rw.Pipe(**{**args, "chunks": 1, **kw})


def _tensor_parallel(tmp: Path, **kw):
    return rw.tensor_parallel(**{"model": _net(), "plan": {"0": "column", "2": "row"}, **kw})


def _column(tmp: Path, **kw):
    return rw.ColumnParallelLinear(**{"linear": nn.Linear(4, 4), **kw})


def _row(tmp: Path, **kw):
    return rw.RowParallelLinear(**{"linear": nn.Linear(4, 4), **kw})


def _vocab_embedding(tmp: Path, **kw):
    return rw.VocabParallelEmbedding(**{"embedding": nn.Embedding(8, 4), **kw})


def _vocab_ce(tmp: Path, **kw):
    args = {"logits": torch.randn(3, 8), "target": torch.tensor([1, 2, 3])}
    return rw.vocab_parallel_cross_entropy(**{**args, **kw})


def _updates_wrap(tmp: Path, **kw):
    model = _net()
    return rw.updates.wrap(**{"model": model, "optimizer": _sgd(model), "rule": "sync", **kw})


S = Session
ENTRIES = [
    ac.Entry("rw.init", rw.init, _init, skip=("debug",)),
    ac.Entry("rt.prepare", S.prepare, _prepare, skip=("scheduler", "wrap")),
    ac.Entry("rt.prepare_loader", S.prepare_loader, _prepare_loader),
    ac.Entry("rt.save", rw.save_checkpoint, _save, skip=("scheduler", "loader")),
    ac.Entry("rt.load", rw.load_checkpoint, _load, skip=("scheduler", "loader", "map_location")),
    ac.Entry("rt.backward", S.backward, _backward),
    ac.Entry("rt.clip_grad_norm_", S.clip_grad_norm_, _clip_norm, skip=("max_norm", "norm_type")),
    ac.Entry("rt.clip_grad_value_", S.clip_grad_value_, _clip_value, skip=("clip_value",)),
    ac.Entry("rt.accumulate", S.accumulate, _accumulate),
    ac.Entry("rt.no_backward_sync", S.no_backward_sync, _no_backward_sync),
    ac.Entry("rt.full_parameters", S.full_parameters, _full_parameters),
    ac.Entry("rt.log", S.log, _log),
    ac.Entry("rt.log_to", S.log_to, _log_to),
    ac.Entry(
        "rw.save_checkpoint", rw.save_checkpoint, _save_checkpoint, skip=("scheduler", "loader")
    ),
    ac.Entry(
        "rw.load_checkpoint",
        rw.load_checkpoint,
        _load_checkpoint,
        skip=("scheduler", "loader", "map_location"),
    ),
    ac.Entry("rw.list_checkpoints", rw.list_checkpoints, _list_checkpoints),
    ac.Entry("rw.loader", rw.loader, _loader),
    ac.Entry("rw.DistributedSampler", rw.DistributedSampler, _sampler),
    ac.Entry("rw.ShardedIterable", rw.ShardedIterable, _sharded_iterable),
    ac.Entry("rw.Loader", rw.Loader, _batch_loader),
    ac.Entry("rw.DeviceMesh", rw.DeviceMesh, _device_mesh, skip=("_groups",)),
    ac.Entry("rw.init_mesh", rw.init_mesh, _init_mesh),
    ac.Entry("rw.Topology", rw.Topology, _topology),
    ac.Entry("rw.DistEnv", rw.DistEnv, _dist_env, skip=("source",)),
    ac.Entry("rw.progress", rw.progress, _progress),
    ac.Entry("rw.join", rw.join, _join),
    ac.Entry("rw.gather_for_metrics", rw.gather_for_metrics, _gather_for_metrics),
    ac.Entry("rw.all_reduce", rw.all_reduce, _comm(rw.all_reduce)),
    ac.Entry("rw.all_reduce_mean", rw.all_reduce_mean, _comm(rw.all_reduce_mean)),
    ac.Entry("rw.broadcast_object", rw.broadcast_object, _comm(rw.broadcast_object)),
    ac.Entry("rw.gather_object", rw.gather_object, _comm(rw.gather_object)),
    ac.Entry("rw.barrier", rw.barrier, _comm(rw.barrier)),
    ac.Entry("rw.launch", rw.launch.launch_function, _launch),
    ac.Entry("rw.get_logger", rw.get_logger, _get_logger, skip=("name",)),  # None: the root
    ac.Entry("rw.unwrap_model", rw.unwrap_model, _unwrap),
    ac.Entry("rw.DataParallel", rw.DataParallel, _data_parallel),
    ac.Entry("rw.DistributedDataParallel", rw.DistributedDataParallel, _ddp),
    ac.Entry("rw.ShardedDataParallel", rw.ShardedDataParallel, _sharded),
    ac.Entry("rw.split", rw.split, _split),
    ac.Entry("rw.Pipe", rw.Pipe, _pipe),
    ac.Entry("rw.tensor_parallel", rw.tensor_parallel, _tensor_parallel),
    ac.Entry("rw.ColumnParallelLinear", rw.ColumnParallelLinear, _column, skip=("memo",)),
    ac.Entry("rw.RowParallelLinear", rw.RowParallelLinear, _row, skip=("memo",)),
    ac.Entry(
        "rw.VocabParallelEmbedding", rw.VocabParallelEmbedding, _vocab_embedding, skip=("memo",)
    ),
    ac.Entry("rw.vocab_parallel_cross_entropy", rw.vocab_parallel_cross_entropy, _vocab_ce),
    ac.Entry("rw.updates.wrap", rw.updates.wrap, _updates_wrap),
]

_SIZES = [0, -1]
EXTRA: dict[str, list] = {
    "rw.init.backend": ["ncclx", "gloo:x"],
    "rw.init.device": ["gpu", "tpu", 3.5, "cuda:99"],
    "rw.init.timeout": ["30", -1, 0, [30]],
    "rw.init.env": ["env", {"rank": 0}],
    "rw.init.strategy": ["fsdp", "DDP_", 3],
    "rw.init.devices": ["cpu", 2, [], ["tpu"], [None]],
    "rw.init.precision": ["fp8", 8, "bf17", 16.5],
    "rw.init.mesh": [{"data": 3}, {"data": 0}, {"data": "1"}, {"data": 1.5}, {3: 1}],
    "rt.prepare.loader": ["data", 5, _data()],
    "rt.prepare.global_batch_size": [*_SIZES, -8],
    "rt.prepare.optimizer": [[torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)]],
    "rt.prepare_loader.loader": [None, "data", 5, _data()],
    "rt.prepare_loader.global_batch_size": _SIZES,
    "rt.save.path": [None],
    "rt.save.step": [-1],
    "rt.save.epoch": [-1],
    "rt.save.keep_last": _SIZES,
    "rt.backward.loss": [1.0],
    "rt.clip_grad_norm_.max_norm": [None, "one", -1.0],
    "rt.clip_grad_norm_.norm_type": [None, "l2"],
    "rt.clip_grad_value_.clip_value": [None, "one", -1.0],
    "rt.accumulate.steps": _SIZES,
    "rt.accumulate.reduction": ["avg"],
    "rt.no_backward_sync.model": [None, "model"],
    "rt.full_parameters.model": [None, "model"],
    "rt.log.metrics": ["loss", None, [0.5]],
    "rt.log.reduce": ["avg"],
    "rt.log_to.log_dir": [3],
    "rw.save_checkpoint.path": [None],
    "rw.save_checkpoint.step": [-1],
    "rw.save_checkpoint.epoch": [-1],
    "rw.save_checkpoint.keep_last": _SIZES,
    "rw.load_checkpoint.path": [None],
    "rw.list_checkpoints.directory": [None],
    "rw.loader.dataset": [None, 5],
    "rw.loader.batch_size": _SIZES,
    "rw.loader.global_batch_size": _SIZES,
    "rw.loader.sampler": ["random"],
    "rw.loader.replicas_in_process": _SIZES,
    "rw.loader.num_replicas": _SIZES,
    "rw.loader.rank": [-1, 5],
    "rw.DistributedSampler.dataset": [None, 5],
    "rw.DistributedSampler.num_replicas": _SIZES,
    "rw.DistributedSampler.rank": [-1, 2],
    "rw.ShardedIterable.dataset": [None, 5],
    "rw.ShardedIterable.num_replicas": _SIZES,
    "rw.ShardedIterable.rank": [-1, 2],
    "rw.ShardedIterable.chunk": _SIZES,
    "rw.Loader.dataloader": [None, _data()],
    "rw.Loader.per_device_batch_size": _SIZES,
    "rw.Loader.num_replicas": _SIZES,
    "rw.Loader.replicas_in_process": _SIZES,
    "rw.DeviceMesh.sizes": [{"data": 0}, {"data": "1"}, {"data": 1.5}, {3: 1}],
    "rw.DeviceMesh.rank": [-1, 2],
    "rw.init_mesh.sizes": [{"data": 2}, {"data": 0}],
    "rw.Topology.nnodes": _SIZES,
    "rw.Topology.nproc_per_node": _SIZES,
    "rw.DistEnv.rank": [-1, 3],
    "rw.DistEnv.world_size": _SIZES,
    "rw.DistEnv.master_port": [0, 70000],
    "rw.progress.iterable": [None, 5],
    "rw.progress.total": [-1],
    "rw.progress.replicas": _SIZES,
    "rw.progress.desc": [3],
    "rw.join.iterable": [None, 5],
    "rw.gather_for_metrics.num_samples": [-1],
    "rw.all_reduce.value": ["x", None],
    "rw.all_reduce.op": ["avg", 3],
    "rw.all_reduce_mean.value": ["x", None],
    "rw.broadcast_object.src": [-1, 1],
    "rw.gather_object.dst": [-1, 1],
    "rw.barrier.timeout": ["30", -1, 0],
    "rw.launch.fn": [None, "train.py"],
    "rw.launch.nprocs": _SIZES,
    "rw.launch.args": [5],
    "rw.launch.kwargs": [[1]],
    "rw.launch.timeout": [-1, 0],
    "rw.launch.env": ["A=1", {"A": 1}],
    "rw.get_logger.name": [3, b"rankwise"],
    "rw.get_logger.level": ["loud"],
    "rw.get_logger.log_dir": [3],
    "rw.unwrap_model.model": [None, "model", [nn.Linear(2, 2)]],
    "rw.DataParallel.device_ids": [3, "cpu", [], ["tpu"]],
    "rw.DataParallel.output_device": ["tpu", 2.5],
    "rw.DataParallel.loss_fn": ["mse", 3],
    "rw.DataParallel.loss_reduction": ["avg", 3],
    "rw.DistributedDataParallel.device_ids": ["cpu", 3, ["tpu"]],
    "rw.DistributedDataParallel.output_device": ["tpu", 2.5],
    "rw.DistributedDataParallel.bucket_cap_mb": _SIZES,
    "rw.DistributedDataParallel.process_group": ["gloo", 3],
    "rw.DistributedDataParallel.compression": ["zip", 3],
    "rw.DistributedDataParallel.shared_memory_reduce": ["false", 1],  # "false" is truthy
    "rw.DistributedDataParallel.hierarchical_reduce": ["no", 0],
    "rw.ShardedDataParallel.stage": [0, 4, -1],
    "rw.ShardedDataParallel.bucket_cap_mb": _SIZES,
    "rw.ShardedDataParallel.unit_numel": _SIZES,
    "rw.ShardedDataParallel.process_group": ["gloo", 3],
    "rw.ShardedDataParallel.wrap": ["Linear", 3],
    "rw.ShardedDataParallel.shared_memory": ["false", 1],
    "rw.ShardedDataParallel.hierarchical_reduce": ["no", 0],
    "rw.split.devices": ["cpu", [], ["tpu", "cpu"], 2],
    "rw.split.balance": [[1, 1], [0, 3], "12", [1.5, 1.5]],
    "rw.split.chunks": _SIZES,
    "rw.Pipe.layers": [None, "layers"],
    "rw.Pipe.devices": [None, ["cpu"]],
    "rw.Pipe.balance": [None, [1, 1]],
    "rw.Pipe.chunks": _SIZES,
    "rw.tensor_parallel.plan": ["column", {"0": "diagonal"}, {"9": "column"}, [("0", "column")]],
    "rw.tensor_parallel.group": ["tp", 3],
    "rw.ColumnParallelLinear.linear": [nn.Embedding(4, 4)],
    "rw.ColumnParallelLinear.group": ["tp", 3],
    "rw.ColumnParallelLinear.chunks": _SIZES,
    "rw.RowParallelLinear.linear": [nn.Embedding(4, 4)],
    "rw.RowParallelLinear.group": ["tp", 3],
    "rw.VocabParallelEmbedding.embedding": [nn.Linear(4, 4)],
    "rw.VocabParallelEmbedding.group": ["tp", 3],
    "rw.vocab_parallel_cross_entropy.logits": [torch.randn(3)],
    "rw.vocab_parallel_cross_entropy.target": [torch.tensor([1.0, 2.0, 3.0])],
    "rw.vocab_parallel_cross_entropy.reduction": ["avg"],
    "rw.vocab_parallel_cross_entropy.group": ["tp", 3],
    "rw.updates.wrap.rule": ["fast", 3],
}

CASES = ac.cases(ENTRIES, EXTRA, MAKE)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_argument_is_a_config_error_naming_it(case: ac.Case, tmp_path: Path) -> None:
    kind, detail = ac.outcome(case, tmp_path)
    assert kind == "named", f"{case.id}: {kind}: {detail}"


def test_census(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """All of them once more, counted: N bad inputs, 0 raw errors."""
    counter = itertools.count()
    result = ac.census(CASES, lambda case: tmp_path / str(next(counter)))
    text = ac.summary(result)
    with capsys.disabled():
        print("\n" + text)
    assert len(CASES) >= 86
    assert not result["raw"] and not result["unnamed"] and not result["accepted"], text


def test_valid_arguments_pass_as_before(tmp_path: Path) -> None:
    """The checks refuse only what is wrong: values torch reads with float(), a numpy seed
    and rank, logging's level names, the root logger, a timedelta; and a disabled progress
    bar."""
    import logging
    from datetime import timedelta

    import numpy as np

    rt, model = _trained()
    twin = _net()
    for p, q in zip(twin.parameters(), model.parameters(), strict=True):
        p.grad = q.grad.clone()
    ours = rt.clip_grad_norm_(model, "0.5", norm_type="inf")
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), "0.5", norm_type="inf")
    assert torch.equal(ours, theirs)
    pairs = zip(model.parameters(), twin.parameters(), strict=True)
    assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
    loader = rw.loader(_data(), batch_size=4, seed=np.int64(1))
    assert len(loader) == 4 and loader.per_device_batch_size == 4
    assert rw.get_logger(None, level="DEBUG") is logging.getLogger()
    rw.barrier(timeout=timedelta(seconds=5))
    assert rw.broadcast_object("x", src=np.int64(0)) == "x"
    assert list(rw.progress([1, 2, 3], disable=True)) == [1, 2, 3]  # was: AttributeError
    logging.getLogger().handlers[:] = [h for h in logging.getLogger().handlers
                                       if not getattr(h, "_rankwise", False)]  # fmt: skip
