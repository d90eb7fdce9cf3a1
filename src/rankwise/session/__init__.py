"""The one-call API: ``rt = rw.init(strategy=...)``, then ``rt.prepare(model, optimizer, loader)``.

The same training loop runs on one device, with DataParallel or with DDP by changing one word:

    rt = rw.init(strategy="auto")          # "single", "dp" or "ddp"
    model, opt, loader = rt.prepare(model, opt, loader)
    for x, y in loader:                    # batches arrive on the right device
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()

``prepare`` does, in the order the seed's pitfalls require: refuse a model that is already
wrapped; move the model to its device, then wrap it (pitfall 1); move optimizer state that was
created elsewhere; rebuild a plain ``DataLoader`` as ``rw.loader`` with our distributed sampler
(pitfall 3), keeping its batch size with the meaning torch gives it under that strategy, said
once in the log (pitfall 4). Printing and saving go through ``rt.print``/``rt.save``, which are
rank-aware (pitfalls 5 and 6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..data import Loader
from ..errors import ConfigError
from .loader import DeviceLoader, describe_batch, prepare_loader
from .model import check_optimizer, move_optimizer_state, prepare_model, refuse_wrapped, wrap
from .strategy import STRATEGIES, Plan, check_same, plan

if TYPE_CHECKING:
    from ..runtime import Runtime

__all__ = [
    "STRATEGIES",
    "DeviceLoader",
    "Plan",
    "check_optimizer",
    "check_same",
    "describe_batch",
    "move_optimizer_state",
    "plan",
    "prepare",
    "prepare_loader",
    "prepare_model",
    "wrap",
]


def prepare(
    rt: Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    loader: DataLoader | Loader | None = None,
    *,
    global_batch_size: int | None = None,
    scheduler: Any = None,
) -> Any:
    """Model (moved, then wrapped), optimizer (state moved), loader (split, batches moved).

    Returns the model alone when only a model is given, ``(model, optimizer)`` without a
    loader, else ``(model, optimizer, loader)``; a ``scheduler`` is appended unchanged (and
    saved/restored by ``rt.save``/``rt.load``). ``rt.precision`` is applied here
    (``rankwise.precision``): autocast around the model's forward, a loss-scaling optimizer
    under 'fp16-mixed'.

    Sync point: all ranks under 'ddp' (the model's parameters are broadcast from rank 0).
    """
    if loader is None and global_batch_size is not None:
        raise ConfigError(
            f"global_batch_size={global_batch_size} was given without a loader",
            fix="pass the loader too: rt.prepare(model, optimizer, loader, global_batch_size=...).",
        )
    refuse_wrapped(rt, model)
    if optimizer is not None:
        check_optimizer(optimizer, model)
    wrapped, optimizer = _with_precision(rt, model, optimizer)
    if scheduler is not None:
        rt.loop.schedulers.append(scheduler)
    tail = () if scheduler is None else (scheduler,)
    if loader is None:
        return wrapped if optimizer is None and not tail else (wrapped, optimizer, *tail)
    prepared = prepare_loader(rt, loader, global_batch_size=global_batch_size)
    rt.loop.loaders.append(prepared)
    return (wrapped, optimizer, prepared, *tail)


def _with_precision(rt: Runtime, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
    from .. import precision

    policy = rt.precision_policy
    precision.convert_module(policy, model)  # 'bf16-true': bf16 parameters, before any copy
    wrapped = prepare_model(rt, model)
    device_type = precision.model_device_type(model, rt.device)
    precision.apply_autocast(policy, wrapped, device_type)
    if optimizer is not None:
        move_optimizer_state(optimizer)  # the model has moved: its state follows
        optimizer = rt._prepare_optimizer(optimizer, device_type)
    return wrapped, optimizer
