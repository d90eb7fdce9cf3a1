"""The model and its optimizer: refuse wrappers, move first, then wrap (docs/pitfalls.md#pitfall-1)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..parallel import DataParallel, DistributedDataParallel, ShardedDataParallel, deferred
from ..pipeline import DistributedPipeline, Pipe
from ..runtime import Runtime
from ..strategies import Strategy

_WRAPPERS = (
    DataParallel,
    DistributedDataParallel,
    ShardedDataParallel,
    DistributedPipeline,
    nn.DataParallel,
    nn.parallel.DistributedDataParallel,
)
"""Models that are already wrapped: ``prepare`` wraps the model itself and refuses these."""


def refuse_wrapped(rt: Runtime, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"rt.prepare() got model={type(model).__name__}, not a torch.nn.Module",
            fix="pass the model first: rt.prepare(model, optimizer, loader).",
        )
    if isinstance(model, _WRAPPERS):
        cls = type(model)
        raise ConfigError(
            f"rt.prepare() got a model already wrapped in {cls.__module__}.{cls.__qualname__}; "
            f"strategy={rt.strategy!r} wraps the model itself",
            fix="pass the bare model: rt.prepare(model.module, ...) (or build the model and "
            "call rt.prepare before wrapping it yourself).",
            rank=rt.rank,
        )


def _spans_devices(model: nn.Module) -> bool:
    """True for a model split over devices (``rw.split``, hand-placed layers): left in place."""
    found = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    return isinstance(model, Pipe) or len(found) > 1


def prepare_model(rt: Runtime, model: nn.Module) -> nn.Module:
    """Move ``model`` to ``rt.device``, then wrap it for ``rt.strategy`` (its registry entry's
    ``wrap`` function, without an optimizer: the sharded strategies refuse that).

    The caller has refused wrapped models (``refuse_wrapped``): ``session.prepare`` does it
    first, before it looks at the optimizer.

    Sync point: all ranks under a multi-process strategy (rank 0's parameters are broadcast).
    """
    how = deferred.plan(model, None, False)
    with agreed_for(rt, how):
        return wrapper(rt.strategy_spec)(rt, model, None, None, how)[0]


Wrap = Callable[[Runtime, nn.Module, Any, Any, Any], tuple[nn.Module, Any]]
"""``fn(rt, model, optimizer, wrap, how)``: ``wrap`` is zero3's unit policy (ignored by the
others); ``how``: a ``deferred.DeferredInit`` for a model built on the meta device, else None."""


def agreed_for(rt: Runtime, how: deferred.DeferredInit | None) -> Any:
    """Every rank of the job draws a meta model's values from one random state (tensor
    peers cut their pieces from the same full tensors). Sync point: all ranks, for a meta
    model (one small collective)."""
    if how is None:
        return contextlib.nullcontext()
    return deferred.agreed(how.exact, how.build_device(rt.device), rt.device)


def refuse_exact_in_bf16(how: deferred.DeferredInit | None, policy: str) -> None:
    if how is not None and how.exact and policy == "bf16-true":
        raise ConfigError(
            "exact_init=True under precision='bf16-true': the model is cast to bf16 before it "
            "is built, so its values would be drawn in bf16, not drawn in fp32 and rounded "
            "as an eager build's are",
            fix="leave exact_init out under 'bf16-true', or use a mixed policy "
            "('bf16-mixed' keeps fp32 parameters).",
        )


def _materialized(rt: Runtime, model: nn.Module, optimizer: Any, how: Any) -> None:
    """A meta model made whole on ``rt.device`` (module by module), before it is wrapped."""
    if how is None:
        return
    deferred.materialize(model, how, rt.device)
    if optimizer is not None:
        deferred.refresh_optimizer(optimizer)


def wrapper(spec: Strategy) -> Wrap:
    """The function named by ``spec.wrap`` ('module:function'), imported now."""
    module, _, name = spec.wrap.partition(":")
    return getattr(importlib.import_module(module), name)


def _moved(rt: Runtime, model: nn.Module) -> bool:
    """Move ``model`` to ``rt.device`` unless it spans devices (returned: True, left in place)."""
    spans = _spans_devices(model)
    if not spans:
        model.to(rt.device)  # move first, then wrap: docs/pitfalls.md#pitfall-1
    return spans


def bare(
    rt: Runtime, model: nn.Module, optimizer: Any, wrap: Any = None, how: Any = None
) -> tuple[nn.Module, Any]:
    """'single': the model itself, on ``rt.device``. No sync point."""
    _materialized(rt, model, optimizer, how)
    _moved(rt, model)
    return model, optimizer


def data_parallel(
    rt: Runtime, model: nn.Module, optimizer: Any, wrap: Any = None, how: Any = None
) -> tuple[nn.Module, Any]:
    """'dp': ``rw.DataParallel`` over ``rt.devices`` (the first is the master). No sync point."""
    _materialized(rt, model, optimizer, how)
    if _spans_devices(model):
        raise ConfigError(
            "strategy='dp' cannot wrap a model split over several devices: DataParallel "
            "copies the whole model to every device",
            fix="use strategy='ddp' (rankwise run --nproc-per-node N) for data parallelism on "
            "top of a split model, or strategy='single'.",
        )
    _moved(rt, model)
    return DataParallel(model, device_ids=list(rt.devices)), optimizer


def data_group(rt: Runtime) -> Any:
    """The group gradients are averaged over: ``rt.mesh``'s data group under
    ``rw.init(mesh=...)`` (tensor and pipeline peers hold other parts of the model), else
    None (every rank)."""
    return None if rt.mesh is None else rt.mesh.group("data")


def data_replicas(rt: Runtime) -> int:
    """How many replicas the data-parallel engine averages (and ZeRO shards) over."""
    return rt.world_size if rt.mesh is None else rt.mesh.sizes["data"]


def distributed(
    rt: Runtime, model: nn.Module, optimizer: Any, wrap: Any = None, how: Any = None
) -> tuple[nn.Module, Any]:
    """'ddp': ``rw.DistributedDataParallel`` over ``data_group(rt)``. Sync point: all ranks
    (rank 0's state is broadcast)."""
    _materialized(rt, model, optimizer, how)
    spans = _moved(rt, model)
    one_accelerator = rt.device.type != "cpu" and not spans
    ids = [rt.device] if one_accelerator else None
    return DistributedDataParallel(model, device_ids=ids, process_group=data_group(rt)), optimizer


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """``optimizer`` must update ``model``'s parameters: others would not stay in sync."""
    mine = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    if foreign:
        shapes = [tuple(p.shape) for p in foreign[:3]]
        raise ConfigError(
            f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(shapes {shapes}{' ...' if len(foreign) > 3 else ''}); they would not be kept in "
            "sync across replicas",
            fix="build the optimizer from the model you pass: "
            "torch.optim.SGD(model.parameters(), ...).",
        )


def move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put optimizer state (e.g. loaded on the CPU) on its parameters' devices."""
    misplaced = any(
        isinstance(v, torch.Tensor) and k != "step" and v.device != p.device
        for p, state in optimizer.state.items()
        for k, v in state.items()
    )
    if misplaced:
        # torch's own loading policy puts each state tensor on its parameter's device (and
        # keeps Adam's `step` counters where torch wants them).
        optimizer.load_state_dict(optimizer.state_dict())
