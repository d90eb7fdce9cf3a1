"""The one-call API: ``rt = rw.init(strategy=...)``, then ``rt.prepare(model, optimizer, loader)``.

The same training loop runs on one device, with DataParallel or with DDP by changing one word:

    rt = rw.init(strategy="auto")          # "single", "dp" or "ddp"
    model, opt, loader = rt.prepare(model, opt, loader)
    for x, y in loader:                    # batches arrive on the right device
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()

``prepare`` does, in the order the pitfalls require (docs/pitfalls.md): refuse a model that is already
wrapped; move the model to its device, then wrap it (pitfall 1); move optimizer state that was
created elsewhere; rebuild a plain ``DataLoader`` as ``rw.loader`` with our distributed sampler
(pitfall 3), keeping its batch size with the meaning torch gives it under that strategy, said
once in the log (pitfall 4). Printing and saving go through ``rt.print``/``rt.save``, which are
rank-aware (pitfalls 5 and 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import runtime
from ..checkpoint import load_checkpoint, save_checkpoint
from ..data import Loader
from ..env import DistEnv
from ..errors import ConfigError
from ..log import print0
from .loader import DeviceLoader, describe_batch, prepare_loader
from .model import check_optimizer, move_optimizer_state, prepare_model, refuse_wrapped

__all__ = [
    "DeviceLoader",
    "Session",
    "check_optimizer",
    "describe_batch",
    "init",
    "move_optimizer_state",
    "prepare",
    "prepare_loader",
    "prepare_model",
    "refuse_wrapped",
]


class Session(runtime.Runtime):
    """What ``rw.init()`` returns: the ``Runtime`` (data: env, device, backend, strategy) plus
    the one-call API. ``prepare``/``prepare_loader`` are this package's functions with the
    runtime filled in; ``print``/``save``/``load`` are aliases of ``rw.print0``,
    ``rw.save_checkpoint`` and ``rw.load_checkpoint`` (one implementation, two spellings).
    """

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loader: Any = None,
        *,
        global_batch_size: int | None = None,
    ) -> Any:
        """``prepare(rt, ...)``: move, then wrap the model; split the loader.

        Sync point: all ranks under 'ddp'.
        """
        return prepare(self, model, optimizer, loader, global_batch_size=global_batch_size)

    def prepare_loader(
        self, loader: Any, *, global_batch_size: int | None = None, evaluation: bool = False
    ) -> Any:
        """``prepare_loader(rt, ...)``: a loader split over the replicas, batches on the
        device; ``evaluation``: each sample once. No sync point."""
        return prepare_loader(
            self, loader, global_batch_size=global_batch_size, evaluation=evaluation
        )

    print = staticmethod(print0)
    """Alias of ``rw.print0``: ``print`` on rank 0 only."""
    save = staticmethod(save_checkpoint)
    """Alias of ``rw.save_checkpoint``: rank 0 writes. Sync point: all ranks."""
    load = staticmethod(load_checkpoint)
    """Alias of ``rw.load_checkpoint``, mapped to this process's device. No sync point."""


def init(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: float | timedelta | None = None,
    env: DistEnv | None = None,
    strategy: str | None = None,
    devices: Sequence[Any] | None = None,
) -> Session:
    """``rw.init``: ``rankwise.runtime.init`` returning a ``Session`` (the one-call API).

    Sync point: all ranks (the rendezvous), when world size > 1.
    """
    return runtime.init(
        backend,
        device=device,
        timeout=timeout,
        env=env,
        strategy=strategy,
        devices=devices,
        kind=Session,
    )


def prepare(
    rt: runtime.Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    loader: DataLoader | Loader | None = None,
    *,
    global_batch_size: int | None = None,
) -> Any:
    """Model (moved, then wrapped), optimizer (state moved), loader (split, batches moved).

    Returns the model alone when only a model is given, ``(model, optimizer)`` without a
    loader, else ``(model, optimizer, loader)``.

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
    wrapped = prepare_model(rt, model)
    if optimizer is not None:
        move_optimizer_state(optimizer)  # the model has moved: its state follows
    if loader is None:
        return wrapped if optimizer is None else (wrapped, optimizer)
    return wrapped, optimizer, prepare_loader(rt, loader, global_batch_size=global_batch_size)
