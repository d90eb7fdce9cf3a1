"""``strategy='auto'`` at ``rt.prepare``: replicated when the training state fits, else ZeRO.

``rw.init`` cannot know the model, so a launched 'auto' run starts as 'ddp' (``rt.auto`` is
True). The first ``rt.prepare`` that sees the model and its optimizer settles it: 'ddp' when
parameters, gradients and optimizer state fit on each device, else the smallest ZeRO stage
that fits (``rankwise.strategies.multi_process`` order), else the stage that needs least.

Every rank must choose the same: the sizes come from the model and the world size (the same
on every rank) and the capacity is the minimum over the ranks (one integer all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import runtime, strategies
from ..comm import collectives as comm
from ..output.log import get_logger
from ..parallel.zero.memory_plan import bytes_per_rank, capacity_bytes, optimizer_states
from .model import data_replicas

if TYPE_CHECKING:
    from ..runtime import Runtime

_UNKNOWN = 2**62
"""Capacity of a rank that cannot tell its memory: it never decides the minimum."""


def settle(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Settle 'auto' on ``rt`` for ``model``; True when it did (and logged why, on rank 0).

    Sync point: all ranks, when ``rt.auto`` and world size > 1 (the capacity's minimum).
    """
    if not rt.auto:
        return False
    if optimizer is None:  # ZeRO shards the optimizer: without one, replicate
        runtime.settle_strategy(rt, rt.strategy)
        return False
    capacity = agreed_capacity(rt)
    name, why = choose(model, optimizer, data_replicas(rt), capacity)
    runtime.settle_strategy(rt, name)
    if rt.rank == 0:
        get_logger("rankwise.session").info(f"rankwise prepare [auto -> {name}]: {why}")
    return True


def agreed_capacity(rt: Runtime) -> int | None:
    """The smallest capacity of any rank (``memory_plan.capacity_bytes``); None if none knows.

    A tensor all-reduce (MIN), not an object collective: nothing is unpickled.
    Sync point: all ranks.
    """
    mine = capacity_bytes(rt.device, rt.env.local_world_size)
    value = torch.tensor([_UNKNOWN if mine is None else mine], dtype=torch.int64)
    least = int(comm.all_reduce(value, "min").item())
    return None if least >= _UNKNOWN else least


def choose(
    model: nn.Module, optimizer: torch.optim.Optimizer, world: int, capacity: int | None
) -> tuple[str, str]:
    """(strategy, why): the first of ``rankwise.strategies.multi_process`` whose training
    state fits ``capacity`` per rank; the least hungry when none does. Pure."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    count = sum(p.numel() for p in params)
    size = params[0].element_size() if params else 4
    k = optimizer_states(optimizer)
    order = [s.name for s in strategies.multi_process()]
    need = {s: bytes_per_rank(count, world, s, element_bytes=size, states=k) for s in order}
    first = order[0]
    head = (
        f"parameters, gradients and {type(optimizer).__name__} state need "
        f"{_size(need[first])} per rank under {first}"
    )
    if capacity is None:
        return first, f"{head}; the device memory is unknown"
    if need[first] <= capacity:
        return first, f"{head}, within the {_size(capacity)} each rank has"
    head += f", more than the {_size(capacity)} of the smallest rank"
    fits = next((s for s in order if need[s] <= capacity), None)
    if fits is not None:
        return fits, f"{head}; {fits} needs {_size(need[fits])}"
    least = min(order, key=need.__getitem__)
    if least == first:
        return first, (
            f"{head}; no ZeRO stage needs less at world size {world}: use more ranks or a "
            "smaller model (docs/zero.md)"
        )
    return least, (
        f"{head}; no ZeRO stage fits either ({least} needs {_size(need[least])}, the least): "
        "use more ranks or a smaller model (docs/zero.md)"
    )


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
