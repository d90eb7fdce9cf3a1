"""The model's side: every tensor a checkpoint fills, where this rank keeps its part of it.

Walks a prepared model (bare, under our DDP or DP, under ZeRO, split by ``rw.tensor_parallel``,
under ``torch.compile``) and lists one ``Target`` per parameter or persistent buffer (a tied
weight once, with all its names), with:

- the unsplit shape (what the file holds) and the tensor-parallel ``Split`` of this rank's
  piece (from the layers' ``tp_splits()``);
- under ZeRO, the flat unit holding it: stage 3 keeps only this rank's range of the unit's
  elements (``unit.shard``), which is all that is written; stages 1 and 2 keep the whole
  parameter (the shard is a view of it).

Nothing here communicates or reads a file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..state_dict import registered_inner
from .slices import Split, copy_range, shard_overlap


@dataclass
class Target:
    """One tensor of the model (see the module text)."""

    names: list[str]
    """Every name it has in the model's state dict; the first is the one to write."""
    tensor: torch.Tensor
    """The parameter or buffer itself (this rank's tensor-parallel piece of it)."""
    full_shape: tuple[int, ...]
    split: Split | None = None
    group: Any = None
    """The tensor-parallel group it is split over (for gathering it whole)."""
    unit: Any = None
    """The ZeRO unit (``parallel/zero/shard_unit.FlatUnit``) it lives in, if any."""
    index: int = 0
    """Its position in ``unit.params``."""

    @property
    def sharded(self) -> bool:
        """True when this rank keeps only a flat range of it (ZeRO-3)."""
        return self.unit is not None and self.unit.stage == 3

    def shard_range(self) -> tuple[int, int]:
        """ZeRO-3: this rank's elements ``[a, b)`` of the (local) tensor."""
        spec = self.unit.spec
        return shard_overlap(spec.offsets[self.index], spec.numels[self.index], self.unit.lo,
                             self.unit.hi)  # fmt: skip


def wrappers(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` and every wrapper level below it, down to the user's model."""
    seen: set[int] = set()
    while isinstance(model, nn.Module) and id(model) not in seen:
        seen.add(id(model))
        yield model
        model = model._modules.get("_orig_mod") or model._modules.get("module")


def zero_engine(model: nn.Module) -> Any:
    """Our ZeRO engine (``rw.ShardedDataParallel``) among the wrappers, or None."""
    return next((m for m in wrappers(model) if hasattr(m, "units") and hasattr(m, "stage")), None)


def _tp_splits(bare: nn.Module) -> dict[int, tuple[Split, Any]]:
    """id(parameter) -> (its split, its group), for every tensor-parallel layer's parameter."""
    found = {}
    for module in bare.modules():
        if not hasattr(module, "tp_splits"):
            continue
        for name, (dim, chunks) in module.tp_splits().items():
            param = getattr(module, name, None)
            if param is not None:
                split = Split(dim, chunks, module.tp_rank, module.tp_size)
                found[id(param)] = (split, module.group)
    return found


def is_split(model: nn.Module) -> bool:
    """True when a tensor-parallel layer splits a tensor over more than one rank."""
    return any(s.size > 1 for s, _ in _tp_splits(registered_inner(model)).values())


def named_state(bare: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every entry ``bare.state_dict()`` has, in its order, without calling
    it (a stage-3 model's tensors are empty between passes; hooks may gather)."""
    for prefix, module in bare.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                yield head + name, p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                yield head + name, b


def _tied_names(bare: nn.Module) -> set[str]:
    """Names Hugging Face saves without (the targets of ``_tied_weights_keys``)."""
    tied = getattr(bare, "_tied_weights_keys", None) or ()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def model_targets(model: nn.Module) -> list[Target]:
    """Every tensor of ``model``'s state dict once, in state-dict order (see the module text)."""
    bare = registered_inner(model)
    engine = zero_engine(model)
    where = {}
    for unit in getattr(engine, "units", ()):
        for k, p in enumerate(unit.params):
            where[id(p)] = (unit, k)
    splits = _tp_splits(bare)
    targets: dict[int, Target] = {}
    for name, tensor in named_state(bare):
        if id(tensor) in targets:
            targets[id(tensor)].names.append(name)
            continue
        split, group = splits.get(id(tensor), (None, None))
        full = list(tensor.shape)
        if split is not None:
            full[split.dim] *= split.size
        unit, k = where.get(id(tensor), (None, 0))
        targets[id(tensor)] = Target([name], tensor, tuple(full), split, group, unit, k)
    tied = _tied_names(bare)
    for t in targets.values():  # HF's tied names last: the file holds the other one
        t.names.sort(key=lambda n: n in tied)
    return list(targets.values())


def _whole(target: Target, read: Any) -> int:
    """Fill the whole (local) tensor; a tensor still on the meta device is given storage."""
    tensor = target.tensor
    if tensor.is_meta:  # swapped in place: every module sharing it (tied weights) sees it
        real = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        if isinstance(tensor, nn.Parameter):
            real = nn.Parameter(real, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, real)
    n = tensor.numel()
    if tensor.is_contiguous():
        return copy_range(read, target.full_shape, target.split, 0, n, tensor.data.view(-1))
    flat = torch.empty(n, dtype=tensor.dtype, device=tensor.device)
    count = copy_range(read, target.full_shape, target.split, 0, n, flat)
    tensor.data.copy_(flat.view(tensor.shape))
    return count


def needs_read(target: Target) -> bool:
    """False for a ZeRO-3 parameter none of whose elements fall in this rank's shard."""
    if not target.sharded or target.unit.gathered_copy:
        return True
    a, b = target.shard_range()
    return a < b


@torch.no_grad()
def fill(target: Target, read: Any) -> int:
    """Write the file's tensor (``read``: its lazy slice) into this rank's part of ``target``;
    returns the elements read from the file."""
    if not target.sharded:
        return _whole(target, read)
    unit = target.unit
    a, b = target.shard_range()
    count = 0
    if a < b:
        start = unit.spec.offsets[target.index] - unit.lo
        out = unit.shard.data[start + a : start + b]
        count = copy_range(read, target.full_shape, target.split, a, b, out)
    if unit.gathered_copy:  # gathered right now (inside full_parameters): its full view too
        count += _whole(target, read)
    return count
