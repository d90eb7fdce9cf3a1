"""Update rules, how replicas agree on parameters: synchronous, asynchronous (parameter server),
local SGD.

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
from .base import UpdateRule
from .gate import StalenessGate
from .local_sgd import LocalSGD, local_sgd
from .server import ServerStats
from .sync import SyncUpdates, synchronous

Rule = Literal["sync", "async", "local_sgd"]
RULES: tuple[str, ...] = ("sync", "async", "local_sgd")


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    strategy: Rule,
    **options: Any,
) -> UpdateRule:
    """The update rule named by a string (a flag, a config): ``wrap(m, opt, "async", staleness=2)``.

    The parameter keeps the name ``strategy`` for compatibility; in rankwise's vocabulary a
    *strategy* is how ``rw.init`` parallelises (single, dp, ddp) and an *update rule* is how
    replicas agree (sync, async, local_sgd).

    Sync point: all ranks.
    """
    if strategy == "sync":
        return synchronous(model, optimizer, **options)
    if strategy == "async":
        return asynchronous(model, optimizer, **options)
    if strategy == "local_sgd":
        return local_sgd(model, optimizer, **options)
    raise ConfigError(
        f"strategy={strategy!r} is not one of {', '.join(RULES)}",
        fix="use 'sync' (the usual choice), 'async' (parameter server) or 'local_sgd'.",
    )


__all__ = [
    "RULES",
    "AsyncUpdates",
    "LocalSGD",
    "Rule",
    "ServerStats",
    "StalenessGate",
    "SyncUpdates",
    "UpdateRule",
    "asynchronous",
    "local_sgd",
    "synchronous",
    "wrap",
]
