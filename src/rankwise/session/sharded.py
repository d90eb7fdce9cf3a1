"""``strategy='zero1' | 'zero2' | 'zero3'`` in the one-call API: the sharded engine.

The user builds the optimizer as usual over ``model.parameters()`` (any parameter groups);
``rt.prepare`` points that optimizer at this rank's flat shards, one shard set per group (the
only parameters the sharded engine's optimizer may see), and returns the engine's optimizer,
which steps it. Schedulers and ``g["lr"]`` writes on either object reach the one that steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError
from .model import data_group, data_replicas

if TYPE_CHECKING:
    from ..parallel import ShardedDataParallel
    from ..parallel.deferred import DeferredInit
    from ..runtime import Runtime


def prepare_sharded(
    rt: Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    wrap: Any = None,
    how: DeferredInit | None = None,
) -> tuple[ShardedDataParallel, torch.optim.Optimizer]:
    """Move ``model`` to ``rt.device`` and wrap it; return it with its sharded optimizer.

    The optimizer the user built (any parameter groups) is pointed at this rank's shards: that
    same object steps, so schedulers built on it keep driving it. ``wrap``: stage 3's unit
    policy (``parallel/zero/wrap.py``). ``how``: a model built on the meta device is
    initialised by the engine, unit by unit, each rank keeping its shards only.

    Sync point: all ranks (the engine broadcasts rank 0's parameters).
    """
    from ..parallel import ShardedDataParallel

    if optimizer is None:
        raise ConfigError(
            f"strategy={rt.strategy!r} shards the optimizer state, so rt.prepare() needs the "
            "optimizer too",
            fix="pass it: model, optimizer = rt.prepare(model, optimizer) (build it over "
            "model.parameters() as usual).",
            rank=rt.rank,
        )
    built = {} if how is None else {"init": how.init, "exact_init": how.exact}
    if how is None:
        model.to(rt.device)  # pitfall 1: move first, then wrap
    engine = ShardedDataParallel(
        model, optimizer, stage=rt.strategy_spec.zero_stage, wrap=wrap,
        process_group=data_group(rt), device=rt.device, **built,
    )  # fmt: skip
    return engine, engine.optimizer


def warn_if_too_big(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Log (rank 0) which ZeRO stage would fit a model whose state does not fit as planned."""
    from ..output.log import get_logger
    from ..parallel.zero.memory_plan import advice, capacity_bytes

    capacity = capacity_bytes(rt.device, rt.env.local_world_size)
    message = advice(model, data_replicas(rt), capacity, optimizer, rt.strategy)
    if message is not None and rt.rank == 0:
        get_logger().warning(message)
