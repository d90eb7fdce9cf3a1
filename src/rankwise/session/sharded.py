"""``strategy='zero1' | 'zero2' | 'zero3'`` in the one-call API: the sharded engine.

The user builds the optimizer as usual over ``model.parameters()``; ``rt.prepare`` rebuilds the
same optimizer class with the same hyperparameters over this rank's flat shards (the only
parameters the sharded engine's optimizer may see) and returns it in place of the original.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import ConfigError
from .model import data_group, data_replicas

if TYPE_CHECKING:
    from ..parallel import ShardedDataParallel
    from ..runtime import Runtime


def _factory(optimizer: torch.optim.Optimizer, strategy: str):
    if len(optimizer.param_groups) != 1:
        raise ConfigError(
            f"strategy={strategy!r} got an optimizer with {len(optimizer.param_groups)} "
            "parameter groups; the sharded engine flattens every parameter into shards that "
            "share one group",
            fix="use one set of hyperparameters with ZeRO, or strategy='ddp' for per-group ones.",
        )
    cls = type(optimizer)
    group = optimizer.param_groups[0]
    hyper = {k: group[k] for k in optimizer.defaults if k in group}
    return lambda params: cls(params, **hyper)


def prepare_sharded(
    rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[ShardedDataParallel, torch.optim.Optimizer]:
    """Move ``model`` to ``rt.device`` and wrap it; return it with its sharded optimizer.

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
    if optimizer.state:
        raise ConfigError(
            f"the optimizer already holds state for {len(optimizer.state)} parameters; "
            f"strategy={rt.strategy!r} rebuilds it over this rank's shards and would drop it",
            fix="call rt.prepare before the first step, and restore a checkpoint afterwards "
            "with rw.load_checkpoint(path, model=model, optimizer=optimizer).",
            rank=rt.rank,
        )
    model.to(rt.device)  # pitfall 1: move first, then wrap
    engine = ShardedDataParallel(
        model, _factory(optimizer, rt.strategy), stage=rt.strategy_spec.zero_stage,
        process_group=data_group(rt),
    )  # fmt: skip
    return engine, engine.optimizer


def warn_if_too_big(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Log (rank 0) which ZeRO stage would fit a model whose state does not fit as planned."""
    from ..log import get_logger
    from ..parallel.zero.memory_plan import advice, capacity_bytes

    capacity = capacity_bytes(rt.device, rt.env.local_world_size)
    message = advice(model, data_replicas(rt), capacity, optimizer, rt.strategy)
    if message is not None and rt.rank == 0:
        get_logger().warning(message)
