"""The model and its optimizer: refuse wrappers, move first, then wrap (docs/pitfalls.md#pitfall-1)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..parallel import DataParallel, DistributedDataParallel, ShardedDataParallel
from ..pipeline import DistributedPipeline, Pipe
from ..runtime import Runtime

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
    """Move ``model`` to ``rt.device``, then wrap it for ``rt.strategy``.

    The caller has refused wrapped models (``refuse_wrapped``): ``session.prepare`` does it
    first, before it looks at the optimizer.

    Sync point: all ranks under 'ddp' (the wrapper broadcasts rank 0's parameters).
    """
    spans = _spans_devices(model)
    if spans and rt.strategy == "dp":
        raise ConfigError(
            "strategy='dp' cannot wrap a model split over several devices: DataParallel "
            "copies the whole model to every device",
            fix="use strategy='ddp' (rankwise run --nproc-per-node N) for data parallelism on "
            "top of a split model, or strategy='single'.",
        )
    if not spans:
        model.to(rt.device)  # move first, then wrap: docs/pitfalls.md#pitfall-1
    return _wrap(rt, model, spans)


def _wrap(rt: Runtime, model: nn.Module, spans: bool) -> nn.Module:
    """The model wrapped in our engine for ``rt.strategy`` ('single': the model itself)."""
    if rt.strategy == "dp":
        return DataParallel(model, device_ids=list(rt.devices))
    if rt.strategy == "ddp":
        one_accelerator = rt.device.type != "cpu" and not spans
        return DistributedDataParallel(model, device_ids=[rt.device] if one_accelerator else None)
    return model


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
