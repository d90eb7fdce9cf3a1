"""The gradient norm of a tensor-parallel model: every element of the unsplit model once.

A tensor-parallel layer's split parameter (``tp_splits``) holds one slice of the full
gradient on each rank of its group: its part of the norm is the sum over the group of each
slice's. A parameter every rank holds whole (layer norms, a row layer's bias, the position
embedding) has the same gradient on every rank of the group (the layers' collectives make it
so; with ``sequence_parallel`` after ``sync_replicated_grads``): counted once, from this rank,
not once per tensor rank. For a p-norm:

    norm^p = sum over groups g (all-reduce over g of this rank's split slices' |.|^p)
           + this rank's whole parameters' |.|^p

(for the inf-norm, max for sum). Engines add their own reduction on top: ZeRO sums each
part over its data group first (each data rank holds a slice of the flat shards), a pipeline
sums the stages afterwards. ``rt.clip_grad_norm_`` and ``ShardedDataParallel.clip_grad_norm_``
use it; docs/model-parallel.md says what it means for clipping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...comm import collectives as comm
from .shards import Group

__all__ = ["NormParts"]

WHOLE = 0
"""The part of the parameters held whole on every rank (index 0 of ``NormParts.local``)."""


class NormParts:
    """Which tensor-parallel group each split parameter of ``model`` is cut over.

    ``part_of(p)``: 0 for a parameter held whole, ``1 + i`` for one split over ``groups[i]``
    (a group of one rank counts as whole). Built from the layers' ``tp_splits`` (walking the
    modules, so wrappers such as our DDP and ZeRO are seen through); no communication.
    """

    def __init__(self, model: nn.Module) -> None:
        self.groups: list[Group] = []
        self._part: dict[int, int] = {}
        for module in model.modules():
            if not hasattr(module, "tp_splits") or getattr(module, "tp_size", 1) < 2:
                continue
            index = next((i for i, g in enumerate(self.groups) if g is module.group), None)
            if index is None:
                self.groups.append(module.group)
                index = len(self.groups) - 1
            for name in module.tp_splits():
                param = getattr(module, name, None)
                if param is not None:
                    self._part[id(param)] = 1 + index

    def part_of(self, param: torch.Tensor) -> int:
        return self._part.get(id(param), WHOLE)

    def local(
        self, pieces: Iterable[tuple[int, torch.Tensor]], norm_type: float, device: torch.device
    ) -> torch.Tensor:
        """``[whole, group 0, group 1, ...]``: the sum of ``|g|^p`` (inf: the max of ``|g|``)
        of this rank's gradient ``pieces`` (``(part, tensor)``), per part, in float64 (a
        float32 sum over many elements drifts by ~1e-4). The same length on every rank."""
        parts = torch.zeros(1 + len(self.groups), dtype=torch.float64, device=device)
        for part, grad in pieces:
            norm = torch.linalg.vector_norm(grad, norm_type, dtype=torch.float64)
            if norm_type == float("inf"):
                parts[part] = torch.maximum(parts[part], norm)
            else:
                parts[part] += norm.pow(norm_type)
        return parts

    def total(self, parts: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The model's ``norm^p`` (inf: the norm) from ``local``'s parts: each split part
        reduced over its group, the whole part as it is. Sync point: the ranks of each
        tensor-parallel group (none without split parameters)."""
        inf = norm_type == float("inf")
        for i, group in enumerate(self.groups):
            part = parts[1 + i : 2 + i]
            comm.all_reduce_(part, "max" if inf else "sum", group=group, label="gradient norm")
        return parts.max() if inf else parts.sum()
