"""Loading a sharded (DCP) checkpoint: each rank reads what it holds, at any world size or mesh.

The model's pieces (``pieces.model_pieces(loading=True)``: a ZeRO-3 rank's shard, a replica's
whole tensors, a tensor-parallel slice, a pipeline stage's layers) are filled straight from
the saved chunks that overlap them (``Reader.fill``); no rank ever builds the full model, so
loading holds no more than the model already does plus one saved chunk. The checkpoint may
come from rankwise at another world size, strategy or mesh, or from torch's own ``dcp.save``
of FSDP2's ``get_state_dict`` (model keys under ``model.`` or ``app.model.``, found by name).
No sync point: every rank reads alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from ...comm import collectives as comm
from ...errors import ConfigError
from .. import rng
from . import dcp_meta
from .optim_pieces import load_optimizer
from .pieces import find_engine, model_shapes, param_names, root_module
from .pieces import model_pieces as _model_pieces
from .read import Reader

_OWN = dcp_meta.OWN + "."


def load_sharded(
    folder: Path, *, model: nn.Module | None = None, optimizer: Any = None, scheduler: Any = None,
    loader: Any = None, strict: bool = True, restore_rng: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Restore what ``save_sharded`` (or ``dcp.save``) wrote; the same result as
    ``load_checkpoint`` on one file: ``step``, ``epoch``, ``extra``, ``meta``, ``path``."""
    with Reader(folder) as reader:
        return load_from(reader, model=model, optimizer=optimizer, scheduler=scheduler,
                         loader=loader, strict=strict, restore_rng=restore_rng)  # fmt: skip


def load_from(
    reader: Reader, *, model: nn.Module | None = None, optimizer: Any = None,
    scheduler: Any = None, loader: Any = None, strict: bool = True, restore_rng: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """``load_sharded`` from an opened ``reader`` (a folder's, or the in-memory replicas')."""
    from ..single import _load_stateful, _resume_epoch

    if model is not None:
        _load_model(model, reader, strict)
    if optimizer is not None and model is None:
        raise ConfigError(
            "loading an optimizer from a sharded checkpoint needs its model too: its state "
            "is keyed by parameter name",
            fix="pass model= as well: rw.load_checkpoint(path, model=model, optimizer=opt).",
        )
    if optimizer is not None:
        names = list(param_names(model).values())
        prefix = reader.optimizer_prefix(names)
        if prefix is not None:
            load_optimizer(optimizer, model, reader, prefix)
    own = {k[len(_OWN) :]: k for k in reader.names() if k.startswith(_OWN)}
    if scheduler is not None and "scheduler" in own:
        scheduler.load_state_dict(reader.blob(own["scheduler"]))
    if loader is not None and "loader" in own:
        _load_stateful(loader, reader.blob(own["loader"]))
    mine = own.get(f"rng.{comm.rank()}")
    if restore_rng and mine is not None:
        rng.restore(reader.blob(mine))
    extra = reader.blob(own["extra"]) if "extra" in own else {}
    manifest = reader.manifest or {}
    meta = {k: v for k, v in manifest.items() if k not in ("items", "files", "metadata", "digest")}
    return {
        "step": manifest.get("step"),
        "epoch": _resume_epoch(manifest.get("epoch"), loader),
        "extra": extra,
        "meta": meta,
        "path": reader.folder,
    }


def _holds_part(model: nn.Module) -> bool:
    """A pipeline stage holds some of the model's layers: other keys are expected."""
    from ...pipeline.distributed import DistributedPipeline

    return any(isinstance(m, DistributedPipeline) for m in _chain(model))


def _chain(model: nn.Module) -> list[nn.Module]:
    out = [model]
    while len(out) < 8:
        inner = out[-1]._modules.get("_orig_mod") or out[-1]._modules.get("module")
        if not isinstance(inner, nn.Module):
            break
        out.append(inner)
    return out


def _load_model(model: nn.Module, reader: Reader, strict: bool) -> None:
    shapes = model_shapes(model)
    prefix = reader.model_prefix(sorted(shapes))
    saved = {k[len(prefix):] for k in reader.names() if k.startswith(prefix)
             and not (prefix == "" and k.startswith((dcp_meta.OPTIM + ".", _OWN, "state.",
                                                     "param_groups.")))}  # fmt: skip
    missing = sorted(set(shapes) - saved)
    unexpected = [] if _holds_part(model) else sorted(saved - set(shapes))
    if strict and (missing or unexpected):
        raise ConfigError(
            f"checkpoint {os.fspath(reader.folder)!r} (the keys its {dcp_meta.METADATA} lists) "
            f"does not fit {type(root_module(model)).__name__}: missing keys {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}",
            fix="load into the same architecture that was saved, or pass strict=False to load "
            "the keys that match.",
        )
    _check_shapes(reader, prefix, {k: v for k, v in shapes.items() if k in saved}, model)
    from ...parallel.zero.comm import node_shared

    node_shared.before_write(find_engine(model))  # zero3's shared units: nobody reads them
    pieces, blobs = _model_pieces(model, loading=True)
    head = len(dcp_meta.MODEL) + 1
    wanted = [p for p in pieces if p.key[head:] in saved]
    for piece in wanted:
        piece.key = prefix + piece.key[head:]
    reader.fill(wanted)
    values = {b.key[head:]: reader.blob(prefix + b.key[head:]) for b in blobs
              if b.key[head:] in saved}  # fmt: skip
    if values:  # non-tensor state (a module's extra state)
        root_module(model).load_state_dict(values, strict=False)


def _check_shapes(reader: Reader, prefix: str, shapes: dict[str, Any], model: nn.Module) -> None:
    wrong = []
    for name, shape in sorted(shapes.items()):
        key = prefix + name
        saved = reader.shape(key) if reader.is_tensor(key) else None
        if saved != shape:
            wrong.append((name, saved, shape))
    if wrong:
        listed = ", ".join(f"{k}: checkpoint {a}, model {b}" for k, a, b in wrong[:8])
        raise ConfigError(
            f"checkpoint {os.fspath(reader.folder)!r} does not fit "
            f"{type(root_module(model)).__name__}: shapes differ for {listed}"
            f"{' ...' if len(wrong) > 8 else ''}",
            fix="build the model with the sizes it was saved with; strict=False skips missing "
            "or unexpected keys, not tensors of another shape.",
        )
