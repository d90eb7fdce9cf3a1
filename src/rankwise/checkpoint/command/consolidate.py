"""``rankwise checkpoint consolidate DIR OUT.pt``: one file from a sharded checkpoint, streamed.

The output is the file ``rw.save_checkpoint`` writes (``single``'s format: the bare model's
state dict, the optimizer's state in torch's index-keyed form, scheduler, loader, step, epoch,
every rank's RNG, ``extra``), so ``rw.load_checkpoint`` loads it into any model or strategy and
``torch.load(weights_only=True)`` reads it. It is written by ``torch_zip``: each full tensor is
assembled from its saved chunks just before its record is written and dropped after, so no
more than one tensor is in memory beyond the bookkeeping, whatever the model's size. Works on
rankwise's checkpoints and on ``dcp.save``'s of torch's ``get_state_dict`` (``model.``/``optim.``
or ``app.model.``/``app.optim.`` keys).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError
from .. import files
from ..sharded import dcp_meta
from ..sharded.boxes import Box
from ..sharded.pieces import Piece
from ..sharded.read import Reader
from ..single import FORMAT, VERSION
from .torch_zip import TensorRef, write

_MODEL_PREFIXES = ("model.", "app.model.")
_OPTIM_PREFIXES = ("optim.", "app.optim.")


def _value(reader: Reader, key: str, refs: list[TensorRef]) -> Any:
    if not reader.is_tensor(key):
        return reader.blob(key)
    ref = TensorRef(str(len(refs)), reader.shape(key), reader.dtype(key))
    ref.source = key  # type: ignore[attr-defined]
    refs.append(ref)
    return ref


def _model(reader: Reader, refs: list[TensorRef]) -> dict[str, Any]:
    names = reader.names()
    prefix = next((p for p in _MODEL_PREFIXES if any(k.startswith(p) for k in names)), None)
    if prefix is None:
        raise ConfigError(
            f"{os.fspath(reader.folder)!r} holds no model state under 'model.' or 'app.model.'",
            fix="consolidate a checkpoint written by rt.save, rw.save_checkpoint(sharded=True) "
            "or dcp.save({'model': ..., 'optim': ...}).",
        )
    return {k[len(prefix) :]: _value(reader, k, refs) for k in names if k.startswith(prefix)}


def _optimizer(reader: Reader, refs: list[TensorRef]) -> dict[str, Any] | None:
    names = reader.names()
    prefix = next((p for p in _OPTIM_PREFIXES if any(k.startswith(p) for k in names)), None)
    if prefix is None:
        return None
    groups = reader.groups(prefix)
    by_name = reader.state_index(prefix)
    order = [f for g in groups for f in g.get("params", ())] or sorted(by_name)
    index = {fqn: i for i, fqn in enumerate(dict.fromkeys(order))}
    state = {
        index[fqn]: {name: _value(reader, key, refs) for name, key in sorted(keys.items())}
        for fqn, keys in by_name.items()
        if fqn in index
    }
    out_groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[f] for f in g.get("params", ())]} for g in groups]  # fmt: skip
    return {"state": state, "param_groups": out_groups}


def _own(reader: Reader) -> dict[str, Any]:
    head = dcp_meta.OWN + "."
    own = {k[len(head) :]: k for k in reader.names() if k.startswith(head)}
    ranks = sorted(int(k[4:]) for k in own if k.startswith("rng.") and k[4:].isdigit())
    return {
        "scheduler": reader.blob(own["scheduler"]) if "scheduler" in own else None,
        "loader": reader.blob(own["loader"]) if "loader" in own else None,
        "extra": reader.blob(own["extra"]) if "extra" in own else {},
        "rng": [reader.blob(own[f"rng.{r}"]) for r in ranks],
    }


def consolidate(folder: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the sharded checkpoint at ``folder`` (or the one its ``latest`` names) as one
    file ``out``, atomically; returns its path."""
    from ..api import resolve

    source, target = resolve(folder), Path(out)
    if not dcp_meta.is_sharded(source):
        raise ConfigError(f"{os.fspath(folder)!r} is not a sharded checkpoint (no .metadata)",
                          fix="pass a folder written by rt.save under a sharded strategy, "
                          "or by rw.save_checkpoint(..., sharded=True).")  # fmt: skip
    with Reader(source) as reader:
        refs: list[TensorRef] = []
        manifest = reader.manifest or {}
        meta = {k: v for k, v in manifest.items() if k not in ("items", "files", "metadata", "digest")}
        own = _own(reader)
        payload = {
            "format": FORMAT, "version": VERSION,
            "model": _model(reader, refs), "optimizer": _optimizer(reader, refs),
            "scheduler": own["scheduler"], "loader": own["loader"],
            "step": manifest.get("step"), "epoch": manifest.get("epoch"), "rng": own["rng"],
            "meta": {**meta, "consolidated_from": os.fspath(source), "saved_at": time.time()},
            "extra": own["extra"],
        }  # fmt: skip
        files.write_atomic(lambda f: _write(f, payload, refs, reader), target)
    return target


def _write(f: Any, payload: dict[str, Any], refs: list[TensorRef], reader: Reader) -> None:
    def fill(ref: TensorRef) -> torch.Tensor:
        full = torch.empty(ref.shape, dtype=ref.dtype)
        box = Box((0,) * len(ref.shape), ref.shape)
        reader.fill([Piece(ref.source, [], ref.shape, box, full, shared=True)])  # type: ignore[attr-defined]
        return full

    write(f, payload, refs, fill)
