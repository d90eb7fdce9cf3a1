"""What one rank holds of the model, as rectangles of the full tensors (``Piece``s).

A sharded save writes, and a sharded load fills, exactly what each rank already holds:

- under ZeRO (``ShardedDataParallel``, any stage) a trainable parameter's share is the part of
  it inside this rank's flat shard: a few rectangles (``boxes.flat_range_boxes``), each a view
  of the shard. Stage 3 loads into those views; stages 1 and 2 hold every parameter whole and
  load whole (the shard is a view of the same buffer);
- everything else (a replicated model under DDP or one process, frozen parameters, buffers) is
  held whole by every replica: ``shared``, so the save writes it once (``sharded_save``
  chooses the writer) and every replica loads it;
- a tensor-parallel layer's slice is placed in its full tensor (``boxes.Split``), so the
  checkpoint holds the unsplit model and loads at any tensor size, or in one process.

The engines are recognised by what they offer (``units``, ``tp_splits()``), not imported: the
engines import this package's ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..state_dict import registered_inner
from .boxes import Box, Split, flat_range_boxes
from .dcp_meta import model_key

if TYPE_CHECKING:
    from ...parallel.zero.engine_view import ShardedEngine


@dataclass
class Piece:
    """A rectangle ``box`` of the full tensor ``key`` (shape ``shape``) and the view of it this
    rank holds (saving: the source; loading: the destination)."""

    key: str
    path: list[Any]
    shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor
    shared: bool
    """True when other ranks hold the same rectangle (replicas): one of them writes it."""


@dataclass
class Blob:
    """A non-tensor value (optimizer settings, RNG state, a scheduler's state): one item."""

    key: str
    path: list[Any]
    value: Any
    shared: bool


def shards_repeat(engine: Any) -> bool:
    """True when other ranks hold the same ZeRO shards: the engine shards over a mesh's data
    group, and the tensor peers of a parameter held whole (a layer norm) hold equal ones."""
    from ...comm import collectives as comm

    return engine.world_size != comm.world_size()


def find_engine(model: Any) -> ShardedEngine | None:
    """The ZeRO engine in ``model`` (itself, or under ``torch.compile``), or None."""
    seen = 0
    while isinstance(model, nn.Module) and seen < 8:
        if hasattr(model, "units") and hasattr(model, "group_params"):
            return model  # type: ignore[return-value]
        model = model._modules.get("_orig_mod") or model._modules.get("module")
        seen += 1
    return None


def root_module(model: nn.Module) -> nn.Module:
    """The user's model: the engine's root under ZeRO, else the bare model under wrappers."""
    engine = find_engine(model)
    return engine._root if engine is not None else registered_inner(model)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer that holds the state: ZeRO's (it has ``engine`` and ``inner``) or the
    torch optimizer under wrappers (the loss scaler's, ``FullOptimState``)."""
    for _ in range(8):
        if hasattr(optimizer, "engine") and hasattr(optimizer, "inner"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def splits_of(root: nn.Module) -> dict[str, Split]:
    """State-dict key -> where its tensor-parallel slice sits (split layers only)."""
    found: dict[str, Split] = {}
    for prefix, module in root.named_modules():
        if not hasattr(module, "tp_splits") or getattr(module, "tp_size", 1) <= 1:
            continue
        for name, (dim, chunks) in module.tp_splits().items():
            tensor = getattr(module, name, None)
            if isinstance(tensor, torch.Tensor):
                key = f"{prefix}.{name}" if prefix else name
                found[key] = Split(dim, chunks, module.tp_rank, module.tp_size, tensor.shape[dim])
    return found


def shard_views(
    shape: torch.Size, offset: int, lo: int, hi: int, flat: torch.Tensor
) -> list[tuple[Box, torch.Tensor]]:
    """The part of a parameter (``shape``, at ``offset`` in its unit's flat buffer) inside the
    shard ``[lo, hi)``, whose data is ``flat``: rectangles in the parameter's own coordinates,
    each with its view of ``flat``."""
    n = 1
    for s in shape:
        n *= s
    a, b = max(offset, lo), min(offset + n, hi)
    out = []
    for box, first in flat_range_boxes(tuple(shape), a - offset, b - offset):
        start = offset + first - lo
        out.append((box, flat[start : start + box.numel].view(box.sizes)))
    return out


def whole(tensor: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """The whole tensor as one rectangle."""
    return [(Box((0,) * tensor.dim(), tuple(tensor.shape)), tensor)]


def globalize(
    key: str, path: list[Any], local_shape: torch.Size, split: Split | None,
    views: Iterable[tuple[Box, torch.Tensor]], shared: bool,
) -> list[Piece]:  # fmt: skip
    """``views`` (rectangles of a tensor-parallel slice, or of a whole tensor when ``split``
    is None) as ``Piece``s of the full tensor."""
    if split is None:
        shape = tuple(local_shape)
        return [Piece(key, path, shape, box, view, shared) for box, view in views]
    shape = split.full_shape(local_shape)
    out = []
    for box, view in views:
        for full_box, start, length in split.to_global(box):
            out.append(Piece(key, path, shape, full_box, view.narrow(split.dim, start, length),
                             shared))  # fmt: skip
    return out


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the user's model (the first, for tied parameters)."""
    return {id(p): n for n, p in root_module(model).named_parameters()}


def state_entries(model: nn.Module) -> dict[str, Any]:
    """The user's model's state-dict keys -> its own tensors (``keep_vars``), as they are.

    Under ZeRO-3 the root's ``state_dict()`` gathers every unit into full copies (a
    collective: ``stage3.Stage3Hooks._full_state``); a sharded save must see the sharded
    parameters themselves, so the entries are read as ``state_dict`` reads them, without its
    hooks: each module's parameters and persistent buffers, its extra state, its children.
    """
    root = root_module(model)
    engine = find_engine(model)
    if engine is None or engine.stage < 3:
        return root.state_dict(keep_vars=True)
    out: dict[str, Any] = {}
    _entries(root, "", out)
    return out


def _entries(module: nn.Module, prefix: str, out: dict[str, Any]) -> None:
    for name, p in module._parameters.items():
        if p is not None:
            out[prefix + name] = p
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            out[prefix + name] = b
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        out[prefix + "_extra_state"] = module.get_extra_state()
    for name, child in module._modules.items():
        if child is not None:
            _entries(child, f"{prefix}{name}.", out)


def model_pieces(model: nn.Module, *, loading: bool) -> tuple[list[Piece], list[Blob]]:
    """This rank's pieces of the model's state (``model.<key>``) and its non-tensor entries.

    Saving under ZeRO, a trainable parameter's pieces are the ones in this rank's shard (each
    written by this rank alone); loading, only stage 3 loads that way (stages 1/2 hold the
    parameters whole). The rest is held whole, shared by the replicas.
    """
    engine = find_engine(model)
    root = root_module(model)
    splits = splits_of(root)
    sharded: dict[int, tuple[Any, int]] = {}
    repeat = engine is not None and shards_repeat(engine)
    if engine is not None and (not loading or engine.stage == 3):
        sharded = {id(p): (u, k) for u in engine.units for k, p in enumerate(u.params)}
    pieces: list[Piece] = []
    blobs: list[Blob] = []
    for name, value in state_entries(model).items():
        key, path = model_key(name)
        if not isinstance(value, torch.Tensor):
            blobs.append(Blob(key, path, value, shared=True))
            continue
        if id(value) in sharded:
            unit, k = sharded[id(value)]
            off = unit.spec.offsets[k]
            views = shard_views(value.shape, off, unit.lo, unit.hi, unit.shard.detach())
        else:
            views = whole(value.detach())
        pieces += globalize(key, path, value.shape, splits.get(name), views,
                            shared=repeat or id(value) not in sharded)  # fmt: skip
    return pieces, blobs


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """Every state-dict key of the user's model -> its full shape (None: not a tensor)."""
    root = root_module(model)
    splits = splits_of(root)
    out: dict[str, tuple[int, ...] | None] = {}
    for name, value in state_entries(model).items():
        if not isinstance(value, torch.Tensor):
            out[name] = None
        else:
            split = splits.get(name)
            out[name] = tuple(value.shape) if split is None else split.full_shape(value.shape)
    return out
