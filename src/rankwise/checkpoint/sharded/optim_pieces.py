"""The optimizer's state in a sharded checkpoint: keyed by parameter name, as torch's
``get_state_dict`` keys it (``optim.state.<fqn>.exp_avg``, ``optim.param_groups.<i>.lr``).

Under ZeRO the optimizer steps flat shards: a state tensor shaped like the shard (Adam's
``exp_avg``) is cut back into each parameter's pieces exactly as the parameters are
(``pieces.shard_views``), so each rank writes and loads only its share; per-shard scalars
(``step``) are the same on every rank and written once. A plain optimizer's state (one process,
DDP, a tensor-parallel slice) is held whole by every replica. Loading builds the state dict
torch's own ``load_state_dict`` takes (shard by shard under ZeRO), so torch moves and casts it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import ConfigError
from .dcp_meta import group_key, state_key
from .pieces import (
    Blob,
    Piece,
    globalize,
    param_names,
    root_module,
    shard_views,
    shards_repeat,
    splits_of,
    unwrap_optimizer,
    whole,
)  # fmt: skip

if TYPE_CHECKING:
    from .read import Reader


def _is_zero(opt: Any) -> bool:
    return hasattr(opt, "engine") and hasattr(opt, "inner")


def _group_blobs(groups: list[dict[str, Any]], names: list[list[str]]) -> list[Blob]:
    out = []
    for i, (group, fqns) in enumerate(zip(groups, names, strict=True)):
        for setting, value in sorted({**group, "params": fqns}.items()):
            out.append(Blob(*group_key(i, setting), value=value, shared=True))
    return out


def optimizer_pieces(optimizer: Any, model: nn.Module) -> tuple[list[Piece], list[Blob]]:
    """This rank's pieces of the optimizer state, and its settings (one blob per value)."""
    opt = unwrap_optimizer(optimizer)
    names = param_names(model)
    splits = splits_of(root_module(model))
    pieces: list[Piece] = []
    blobs: list[Blob] = []
    if _is_zero(opt):
        engine, inner = opt.engine, opt.inner
        repeat = shards_repeat(engine)
        for unit, group in zip(engine.units, engine.unit_group, strict=True):
            if group is None:
                continue
            for name, value in inner.state.get(unit.shard, {}).items():
                flat = isinstance(value, torch.Tensor) and value.shape == unit.shard.shape
                for k, p in enumerate(unit.params):
                    key, path = state_key(names[id(p)], name)
                    if flat:
                        views = shard_views(p.shape, unit.spec.offsets[k], unit.lo, unit.hi,
                                            value.detach())  # fmt: skip
                        pieces += globalize(key, path, p.shape, splits.get(names[id(p)]), views,
                                            shared=repeat)  # fmt: skip
                    else:
                        pieces, blobs = _add_whole(pieces, blobs, key, path, value)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        fqns = [[names[id(p)] for p in params] for params in engine.group_params]
        return pieces, blobs + _group_blobs(groups, fqns)
    for p, state in ((p, opt.state.get(p, {})) for p in _ordered(opt)):
        fqn = _name(names, p)
        for name, value in state.items():
            key, path = state_key(fqn, name)
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                pieces += globalize(key, path, p.shape, splits.get(fqn), whole(value.detach()),
                                    shared=True)  # fmt: skip
            else:
                pieces, blobs = _add_whole(pieces, blobs, key, path, value)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    fqns = [[_name(names, p) for p in g["params"]] for g in opt.param_groups]
    return pieces, blobs + _group_blobs(groups, fqns)


def _add_whole(pieces, blobs, key, path, value):
    if isinstance(value, torch.Tensor):
        pieces += globalize(key, path, value.shape, None, whole(value.detach()), shared=True)
    else:
        blobs.append(Blob(key, path, value, shared=True))
    return pieces, blobs


def _ordered(opt: Any) -> list[nn.Parameter]:
    """Parameters in the order of torch's state-dict indices (group after group, once each)."""
    seen: dict[int, nn.Parameter] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _name(names: dict[int, str], p: nn.Parameter) -> str:
    if id(p) not in names:
        raise ConfigError(
            f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a parameter of "
            "the model, so it has no name in a sharded checkpoint",
            fix="build the optimizer over model.parameters() of the model you save.",
        )
    return names[id(p)]


# -- loading ---------------------------------------------------------------------------


def load_optimizer(optimizer: Any, model: nn.Module, reader: Reader, prefix: str) -> None:
    """Fill ``optimizer`` from the checkpoint's ``<prefix>state.*`` and ``param_groups``:
    each rank reads only what it holds. No sync point."""
    opt = unwrap_optimizer(optimizer)
    names = param_names(model)
    index = reader.state_index(prefix)
    splits = splits_of(root_module(model))
    pieces: list[Piece] = []
    if _is_zero(opt):
        engine, inner = opt.engine, opt.inner
        state = _zero_state(engine, inner, names, index, splits, reader, pieces)
        ours = [[names[id(p)] for p in params] for params in engine.group_params]
        target = inner
    else:
        state = {}
        for i, p in enumerate(_ordered(opt)):
            fqn = _name(names, p)
            held = opt.state.get(p, {})
            entry = {n: _dest(reader, key, p, p.shape, splits.get(fqn), pieces, held.get(n))
                     for n, key in sorted(index.get(fqn, {}).items())}  # fmt: skip
            if entry:
                state[i] = entry
        ours = [[_name(names, p) for p in g["params"]] for g in opt.param_groups]
        target = opt
    reader.fill(pieces)
    groups = _matched_groups(reader, prefix, ours, target.param_groups)
    target.load_state_dict({"state": state, "param_groups": groups})


def _zero_state(engine, inner, names, index, splits, reader, pieces) -> dict[int, Any]:
    shards = [p for g in inner.param_groups for p in g["params"]]
    number = {id(s): i for i, s in enumerate(shards)}
    state: dict[int, Any] = {}
    for unit, group in zip(engine.units, engine.unit_group, strict=True):
        fqns = [names[id(p)] for p in unit.params]
        wanted = sorted({n for f in fqns for n in index.get(f, {})})
        if group is None or not wanted:
            continue
        out = {}
        for name in wanted:
            holders = [(k, index[f][name]) for k, f in enumerate(fqns) if name in index.get(f, {})]
            k0, key0 = holders[0]
            p0 = unit.params[k0]
            if not reader.is_param_shaped(key0, p0.shape, splits.get(fqns[k0])):
                _refuse_unflat(reader, key0, p0, splits.get(fqns[k0]))
                out[name] = _dest(reader, key0, p0, p0.shape, None, pieces, None, whole_local=False)
                continue
            held = inner.state.get(unit.shard, {}).get(name)  # resumed in place: no second copy
            flat = _reuse(held, (unit.shard.numel(),), reader.dtype(key0), unit.device)
            flat.zero_()  # the padding, and parameters the checkpoint has no state for
            for k, key in holders:
                p = unit.params[k]
                views = shard_views(p.shape, unit.spec.offsets[k], unit.lo, unit.hi, flat)
                pieces += globalize(key, [], p.shape, splits.get(fqns[k]), views, shared=False)
            out[name] = flat
        state[number[id(unit.shard)]] = out
    return state


def _reuse(held: Any, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """The state tensor the optimizer already holds when it fits, else a new one."""
    fits = isinstance(held, torch.Tensor) and tuple(held.shape) == tuple(shape)
    if fits and held.dtype == dtype and held.device == torch.device(device):
        return held
    return torch.empty(shape, dtype=dtype, device=device)


def _refuse_unflat(reader: Reader, key: str, p: nn.Parameter, split: Any) -> None:
    if reader.is_tensor(key) and reader.shape(key) != ():
        full = tuple(p.shape) if split is None else split.full_shape(p.shape)
        raise ConfigError(
            f"the checkpoint's {key!r} has shape {reader.shape(key)}, neither a scalar nor the "
            f"parameter's {full}: it cannot be cut into this rank's flat shard",
            fix="load a checkpoint of the same model and optimizer class.",
        )


def _dest(reader, key, p, local_shape, split, pieces, held: Any, whole_local: bool = True) -> Any:
    """Where the value of ``key`` goes: a tensor shaped like ``p``'s slice (filled by the
    pieces; the optimizer's own when it fits), a saved scalar or other tensor read whole, or
    a non-tensor value."""
    if not reader.is_tensor(key):
        return reader.blob(key)
    if whole_local and reader.is_param_shaped(key, local_shape, split):
        dest = _reuse(held, tuple(local_shape), reader.dtype(key), p.device)
        pieces += globalize(key, [], local_shape, split, whole(dest), shared=True)
        return dest
    shape = reader.shape(key)
    dest = torch.empty(shape, dtype=reader.dtype(key))
    pieces += globalize(key, [], torch.Size(shape), None, whole(dest), shared=True)
    return dest


def _matched_groups(reader: Reader, prefix: str, ours: list[list[str]], groups: list[dict]):
    """Our parameter groups with the saved settings of the group holding their names."""
    saved = reader.groups(prefix)
    out = []
    for j, (fqns, group) in enumerate(zip(ours, groups, strict=True)):
        count = len(group["params"])
        start = sum(len(g["params"]) for g in groups[:j])
        # the saved group holding these names (all of them: a pipeline stage holds a part)
        match = next((s for s in saved if set(fqns) <= set(s.get("params", ()))), None)
        if match is None and saved:
            raise ConfigError(
                f"the checkpoint's optimizer groups hold {[len(s.get('params', ())) for s in saved]}"
                f" parameters, this optimizer's {[len(f) for f in ours]}: group {j} "
                f"({fqns[:3]}{' ...' if len(fqns) > 3 else ''}) has no saved counterpart",
                fix="load a checkpoint of the same model, saved from an optimizer with the same "
                "parameter groups.",
            )
        settings = {k: v for k, v in (match or group).items() if k != "params"}
        out.append({**settings, "params": list(range(start, start + count))})
    return out
