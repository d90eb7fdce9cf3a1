"""How replicas agree on parameters: synchronous, asynchronous (parameter server), local SGD.

Choose in one place, by wrapping the optimizer; the training loop stays the same::

    opt = rw.updates.asynchronous(model, torch.optim.SGD(model.parameters(), lr=0.1), staleness=2)
    with opt:
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..errors import ConfigError
from .asynchronous import AsyncUpdates, asynchronous
from .base import UpdateStrategy
from .gate import StalenessGate
from .local_sgd import LocalSGD, local_sgd
from .server import ServerStats
from .sync import SyncUpdates, synchronous

Strategy = Literal["sync", "async", "local_sgd"]
STRATEGIES: tuple[str, ...] = ("sync", "async", "local_sgd")


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    strategy: Strategy,
    **options: Any,
) -> UpdateStrategy:
    """The strategy named by a string (from a flag or a config): ``wrap(m, opt, "async", staleness=2)``.

    Sync point: all ranks.
    """
    if strategy == "sync":
        return synchronous(model, optimizer, **options)
    if strategy == "async":
        return asynchronous(model, optimizer, **options)
    if strategy == "local_sgd":
        return local_sgd(model, optimizer, **options)
    raise ConfigError(
        f"strategy={strategy!r} is not one of {', '.join(STRATEGIES)}",
        fix="use 'sync' (the usual choice), 'async' (parameter server) or 'local_sgd'.",
    )


__all__ = [
    "STRATEGIES",
    "AsyncUpdates",
    "LocalSGD",
    "ServerStats",
    "StalenessGate",
    "Strategy",
    "SyncUpdates",
    "UpdateStrategy",
    "asynchronous",
    "local_sgd",
    "synchronous",
    "wrap",
]
