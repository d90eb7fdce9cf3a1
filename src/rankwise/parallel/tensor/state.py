"""Checkpoints that do not depend on the mesh: full tensors in the file, slices in the model.

``full_state_dict`` gathers every split parameter into the full tensor (the unsplit model's
keys and shapes), so rank 0 writes the very file an unsplit model would. ``load_full_state_dict``
slices full tensors for this rank, at whatever tensor size the model was split to now. With
``rw.save_checkpoint``/``rw.load_checkpoint``, pass ``model=FullState(model)``: the checkpoint
takes its state on every rank (the gather is a collective) and hands the loaded one back to be
sliced. ``FullOptimState(optimizer, model)`` does the same for the optimizer: each state tensor
shaped like a split parameter (Adam's ``exp_avg``/``exp_avg_sq``, SGD's momentum) is gathered
into the unsplit parameter's shape, so the file is the one an unsplit optimizer writes and
resumes at any mesh, or in a plain process. ``rt.save``/``rt.load`` wrap both for a
tensor-parallel model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...checkpoint.state_dict import registered_inner, strip_prefixes
from .shards import shard, unshard

__all__ = [
    "FullOptimState", "FullState", "full_state_dict", "has_split_layers", "load_full_state_dict",
]  # fmt: skip


def _split_keys(model: nn.Module) -> dict[str, tuple[nn.Module, int, int]]:
    """State-dict key -> (its tensor-parallel layer, dim, chunks), for every split tensor."""
    found = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "tp_splits"):
            for name, (dim, chunks) in module.tp_splits().items():
                found[f"{prefix}.{name}" if prefix else name] = (module, dim, chunks)
    return found


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict (CPU tensors), on every rank; ``model`` may be wrapped
    by our DDP or ZeRO (whose own state dict, consolidated over the data group, is the source).
    Sync point: all ranks of the mesh (one all-gather per split tensor in each tensor group,
    and ZeRO's gather over the data group).
    """
    bare = registered_inner(model)  # its structure: ZeRO-3's values come from its state_dict
    splits = _split_keys(bare)
    collective = getattr(model, "collective_state_dict", False)
    out = {}
    for key, value in strip_prefixes((model if collective else bare).state_dict()).items():
        if key in splits and splits[key][0].tp_size > 1:
            layer, dim, chunks = splits[key]
            pieces = [torch.empty_like(value) for _ in range(layer.tp_size)]
            dist.all_gather(pieces, value.contiguous(), group=layer.group)
            value = unshard(pieces, dim, chunks)
        out[key] = value.detach().cpu().clone()
    return out


def load_full_state_dict(
    model: nn.Module, state: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Load an unsplit model's state dict into a tensor-parallel ``model`` (bare, or wrapped
    by our DDP or ZeRO): each split tensor is sliced for this rank first. No sync point (none
    beyond ZeRO's own ``load_state_dict``)."""
    bare = registered_inner(model)
    splits = _split_keys(bare)
    local = {}
    for key, value in strip_prefixes(dict(state)).items():
        if key in splits and isinstance(value, torch.Tensor):
            layer, dim, chunks = splits[key]
            value = shard(value, dim, layer.tp_rank, layer.tp_size, chunks)
        local[key] = value
    if getattr(model, "collective_state_dict", False):
        model.load_state_dict(local, strict=strict)  # ZeRO keeps its data-parallel slice
        return
    from ...checkpoint import load_model_state  # the same key and shape checks as unsplit

    load_model_state(bare, local, strict=strict)


class FullState(nn.Module):
    """A view of a tensor-parallel model for ``rw.save_checkpoint``/``rw.load_checkpoint``:
    its ``state_dict()`` is the full one (a collective, taken on every rank) and its
    ``load_state_dict`` slices. ``rw.save_checkpoint(path, model=FullState(model))``.
    """

    collective_state_dict = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return full_state_dict(self.module)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        load_full_state_dict(self.module, state, strict=strict)


def has_split_layers(model: nn.Module) -> bool:
    """True when a tensor-parallel layer of ``model`` is split over more than one rank."""
    return any(
        getattr(m, "tp_size", 1) > 1 for m in registered_inner(model).modules() if hasattr(m, "tp_splits")
    )


def _split_params(model: nn.Module) -> dict[int, tuple[nn.Module, int, int]]:
    """id(split parameter) -> (its tensor-parallel layer, dim, chunks)."""
    found = {}
    for module in registered_inner(model).modules():
        if hasattr(module, "tp_splits") and module.tp_size > 1:
            for name, (dim, chunks) in module.tp_splits().items():
                param = getattr(module, name, None)
                if param is not None:
                    found[id(param)] = (module, dim, chunks)
    return found


def _state_order(optimizer: Any) -> list[nn.Parameter]:
    """The model parameters in the order of the optimizer's ``state_dict`` indices: torch
    numbers them group after group, each once; ZeRO's consolidated state numbers its
    engine's groups the same way (its own ``param_groups`` hold flat shards)."""
    engine = getattr(optimizer, "engine", None)
    groups = (
        engine.group_params if engine is not None else [g["params"] for g in optimizer.param_groups]
    )
    seen: dict[int, nn.Parameter] = {}
    for params in groups:
        for p in params:
            seen.setdefault(id(p), p)
    return list(seen.values())


class FullOptimState:
    """A view of an optimizer over a tensor-parallel model for ``rw.save_checkpoint``/
    ``rw.load_checkpoint`` (``optimizer=FullOptimState(opt, model)``): its ``state_dict()`` is
    the unsplit model's optimizer state (a collective, taken on every rank: one all-gather per
    split parameter and state tensor, in each tensor group; ZeRO's own gather first), and its
    ``load_state_dict`` slices each such tensor for this rank. No sync point in loading.
    """

    collective_state_dict = True

    def __init__(self, optimizer: Any, model: nn.Module) -> None:
        self.optimizer, self.model = optimizer, model

    def _splits(self) -> dict[int, tuple[nn.Parameter, nn.Module, int, int]]:
        """State index -> (parameter, layer, dim, chunks) for each split parameter."""
        split = _split_params(self.model)
        return {i: (p, *split[id(p)]) for i, p in enumerate(_state_order(self.optimizer))
                if id(p) in split}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        out = self.optimizer.state_dict()
        state = out["state"]
        for i, (p, layer, dim, chunks) in sorted(self._splits().items()):
            if i not in state:
                continue
            state[i] = dict(state[i])  # torch's state_dict shares the live per-parameter dicts
            for key in sorted(state[i]):
                value = state[i][key]
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    pieces = [torch.empty_like(value) for _ in range(layer.tp_size)]
                    dist.all_gather(pieces, value.contiguous(), group=layer.group)
                    state[i][key] = unshard(pieces, dim, chunks)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        local = dict(state_dict)
        local["state"] = state = {k: dict(v) for k, v in state_dict["state"].items()}
        for i, (p, layer, dim, chunks) in self._splits().items():
            full_shape = list(p.shape)
            full_shape[dim] *= layer.tp_size
            for key, value in state.get(i, {}).items():
                if isinstance(value, torch.Tensor) and list(value.shape) == full_shape:
                    state[i][key] = shard(value, dim, layer.tp_rank, layer.tp_size, chunks)
        self.optimizer.load_state_dict(local)
