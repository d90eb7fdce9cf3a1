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

import warnings
from typing import Any, Literal

import torch

from .. import validate
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
    rule: Rule | None = None,
    *,
    strategy: Rule | None = None,
    **options: Any,
) -> UpdateRule:
    """The update rule named by a string (a flag, a config): ``wrap(m, opt, "async", staleness=2)``.

    ``rule`` is one of ``RULES``; ``options`` go to that rule's function. ``strategy=`` is the
    deprecated name of ``rule=`` (in rankwise a *strategy* is how ``rw.init`` parallelises:
    single, dp, ddp; an *update rule* is how replicas agree: sync, async, local_sgd).

    Sync point: all ranks.
    """
    validate.module("model", model, where="rw.updates.wrap()")
    validate.optimizer("optimizer", optimizer, optional=False, where="rw.updates.wrap()")
    keyword, name = _rule_argument(rule, strategy)
    if name == "sync":
        return synchronous(model, optimizer, **options)
    if name == "async":
        return asynchronous(model, optimizer, **options)
    if name == "local_sgd":
        return local_sgd(model, optimizer, **options)
    raise ConfigError(
        f"{keyword}={name!r} is not one of {', '.join(RULES)}",
        fix="use 'sync' (the usual choice), 'async' (parameter server) or 'local_sgd'.",
    )


def _rule_argument(rule: str | None, strategy: str | None) -> tuple[str, str | None]:
    """(the keyword the caller used, its value); ``strategy=`` warns, both at once is refused."""
    if strategy is None:
        return "rule", rule
    if rule is not None:
        raise ConfigError(
            f"rw.updates.wrap got both rule={rule!r} and strategy={strategy!r}",
            fix="pass only rule= (strategy= is its deprecated name).",
        )
    warnings.warn(
        "rw.updates.wrap(strategy=...) is deprecated: pass rule=... (the update rule: "
        f"{', '.join(RULES)})",
        DeprecationWarning,
        stacklevel=3,
    )
    return "strategy", strategy


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
