"""The types ``sharded_optim`` and ``stage3`` name: the optimizer factory and what they read of
the engine. ``ShardedDataParallel`` (in ``sharded``) builds both helpers, so they name this leaf
rather than ``sharded``: no import circle, not even through annotations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .shard_unit import FlatUnit

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds the inner optimizer over this rank's flat shards."""


class ShardedEngine(Protocol):
    """What the sharded optimizer and the stage-3 hooks read of ``ShardedDataParallel``."""

    module: nn.Module
    stage: int
    rank: int
    world_size: int
    process_group: Any
    names: list[str]
    params: list[nn.Parameter]
    units: list[FlatUnit]
    stage3: Any
    hierarchical_reduce: bool | None
    shared_memory: bool | None
    """Shared memory between the ranks of one machine (``comm/shared``, ``comm/node_shared``)."""
    """Node-first collectives across nodes: None when the job spans nodes (``hier_comm``)."""
    """The stage-3 hooks, or None under stages 1 and 2."""
    _active: bool
    _full: bool
    """True while ``full_parameters()`` holds every unit gathered."""
    _root: nn.Module
    """The user's model (``module`` refuses access outside ``full_parameters`` at stage 3)."""
    group_params: list[list[nn.Parameter]]
    """The optimizer's parameter groups, over the model's parameters."""
    unit_group: list[int | None]
    """Each unit's parameter group (None: a unit of frozen parameters)."""

    def _begin(self) -> None: ...

    def _after_step(self) -> None: ...
