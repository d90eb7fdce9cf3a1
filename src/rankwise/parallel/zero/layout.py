"""Pure shard layout for the sharded engine: which parameters share a flat buffer, who owns what.

A *unit* is a group of parameters stored end to end in one flat buffer, padded to a multiple of
the world size N and cut into N equal, contiguous shards: rank r owns elements
``[r*S, (r+1)*S)`` with ``S = padded / N``. Every unit is split evenly, so each rank owns 1/N of
every unit and the ranks stay balanced by element count whatever the parameter sizes; a
parameter may straddle two shards (an optimizer whose state is per element does not care).

Units are the grain of communication: one reduce-scatter (or all-reduce) of gradients per unit
during backward, one all-gather of parameters per unit.

- Stages 1 and 2 take the units from ``buckets.assign_buckets``: reverse registration order
  with a size cap, so the first unit's gradients are complete first, as in our DDP.
- Stage 3 takes them from the module tree (:func:`module_units`): the parameters a module's
  forward needs are gathered just before it runs and freed after.

Nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True, kw_only=True)
class UnitLayout:
    """Where each parameter of one unit lives in its flat buffer, and each rank's shard."""

    indices: tuple[int, ...]
    """Positions of the unit's parameters in the engine's parameter list, in layout order."""
    offsets: tuple[int, ...]
    """Element offset of each parameter inside the flat buffer."""
    numels: tuple[int, ...]
    """Element count of each parameter."""
    padded: int
    """Length of the flat buffer: the parameters' total, rounded up to a multiple of N."""
    world_size: int
    """N: how many shards the buffer is cut into."""

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(start, end)`` of ``rank``'s shard in the flat buffer."""
        s = self.shard_numel
        return rank * s, (rank + 1) * s


def layout(
    numels: Sequence[int], groups: Sequence[Sequence[int]], world_size: int
) -> list[UnitLayout]:
    """One :class:`UnitLayout` per group of parameter indices (empty groups are dropped)."""
    units = []
    for group in groups:
        if not group:
            continue
        offsets, total = [], 0
        for i in group:
            offsets.append(total)
            total += numels[i]
        padded = -(-max(total, 1) // world_size) * world_size
        units.append(
            UnitLayout(
                indices=tuple(group),
                offsets=tuple(offsets),
                numels=tuple(numels[i] for i in group),
                padded=padded,
                world_size=world_size,
            )
        )
    return units


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Modules that hold others but are never called: their forward hooks would never fire."""


def module_units(
    root: nn.Module,
    params: Sequence[nn.Parameter],
    min_numel: int,
    wrap: Callable[[nn.Module], bool | None] | None = None,
) -> list[tuple[nn.Module, list[int]]]:
    """Stage 3 units: ``(module, parameter indices)``, innermost first, the root's unit last.

    Walking the tree children-first, a module becomes a unit when ``wrap(module)`` says True (a
    wrap policy, as FSDP's ``auto_wrap_policy``: by module class, e.g. one transformer block per
    unit; see ``wrap.py``) or, where it says None or there is no policy, when the parameters
    below it that no inner unit has claimed hold at least ``min_numel`` elements (size-based). Containers that are never called (``ModuleList``) cannot be units;
    what they hold falls to the module above. A parameter owned by two modules (tied weights,
    e.g. an embedding shared with the output layer) always goes to the root's unit, which stays
    gathered for the whole forward and backward pass, so both users see it.
    """
    index = {id(p): i for i, p in enumerate(params)}
    owners: dict[int, set[int]] = {}
    for mod in root.modules():
        for p in mod.parameters(recurse=False):
            if id(p) in index:
                owners.setdefault(index[id(p)], set()).add(id(mod))
    claimed = {i for i, mods in owners.items() if len(mods) > 1}
    units: list[tuple[nn.Module, list[int]]] = []
    seen: set[int] = set()

    def visit(mod: nn.Module) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for child in mod.children():
            visit(child)
        if mod is root or isinstance(mod, _CONTAINERS):
            return
        mine = sorted({index[id(p)] for p in mod.parameters() if id(p) in index} - claimed)
        if not mine:
            return
        chosen = None if wrap is None else wrap(mod)
        if chosen if chosen is not None else sum(params[i].numel() for i in mine) >= min_numel:
            units.append((mod, mine))
            claimed.update(mine)

    visit(root)
    taken = {i for _, mine in units for i in mine}
    rest = [i for i in range(len(params)) if i not in taken]
    units.append((root, rest))
    return units


def split_by_group(
    units: Sequence[tuple[Any, list[int]]], group_of: Sequence[int | None]
) -> list[tuple[Any, list[int], int | None]]:
    """Each unit cut into one unit per optimizer parameter group: ``(owner, indices, group)``.

    A flat shard is one tensor to the optimizer, so it can carry one group's hyperparameters
    (nanoGPT's decay / no-decay groups put a Linear's weight and bias in different groups).
    The pieces keep the unit's owner and order; groups in ascending order, parameters the
    optimizer does not hold (``None``) last.
    """
    out: list[tuple[Any, list[int], int | None]] = []
    for owner, indices in units:
        keys = sorted({group_of[i] for i in indices}, key=lambda g: (g is None, g or 0))
        for key in keys:
            out.append((owner, [i for i in indices if group_of[i] == key], key))
    return out
