"""torch DCP's on-disk metadata for rankwise's sharded checkpoints: the key layout, writing
``.metadata`` from what the ranks wrote, reading it back without running code.

**Key layout** (what ``dcp.save({"model": ..., "optim": ...})`` of torch's
``get_state_dict(model, optimizer)`` writes, as torch's DCP tutorial does, minus its ``app.``):

- ``model.<fqn>``: the bare model's state dict (no ``module.``/``_orig_mod.``), full shapes;
- ``optim.state.<fqn>.<name>``: optimizer state keyed by parameter name (``exp_avg`` shaped
  like the parameter, ``step`` a scalar), as torch's ``get_state_dict`` keys it;
- ``optim.param_groups.<i>.<setting>``: each group's hyperparameters, ``params`` the names;
- under the prefix ``rankwise``: ``.rng.<rank>`` (each rank's RNG), ``.scheduler``,
  ``.loader``, ``.extra``: what resumes a run exactly; torch's loaders ignore keys they are
  not asked for.

``.metadata`` is torch's ``Metadata`` pickled, as DCP writes it, so ``dcp.load`` and
``dcp_to_torch_save`` read our checkpoints. torch reads it with ``pickle.load``, which would
run whatever a crafted file names; ``read_metadata`` unpickles only DCP's own metadata classes
(``torch.Size``, dtypes, paths) and refuses anything else, naming it.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ConfigError
from .. import untrusted
from ..untrusted import RestrictedUnpickler
from .boxes import Box, tiling_problem

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_md

METADATA = ".metadata"
MANIFEST = "rankwise.json"
MODEL, OPTIM, OWN = "model", "optim", "rankwise"
MAX_METADATA_BYTES = 1 << 30

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}  # fmt: skip
"""What a DCP ``.metadata`` pickle may name: its own dataclasses and plain values."""


def _md() -> Any:
    """torch DCP's metadata classes, imported when first needed: importing
    ``torch.distributed.checkpoint`` brings DTensor and takes ~1 s, which every worker of every
    job would otherwise pay at ``import rankwise`` (the in-memory replicas' restart, docs/elastic.md)."""
    from torch.distributed.checkpoint import metadata

    return metadata


def _fs() -> Any:
    from torch.distributed.checkpoint import filesystem

    return filesystem


def model_key(fqn: str) -> tuple[str, list[Any]]:
    return f"{MODEL}.{fqn}", [MODEL, fqn]


def state_key(fqn: str, name: str) -> tuple[str, list[Any]]:
    return f"{OPTIM}.state.{fqn}.{name}", [OPTIM, "state", fqn, name]


def group_key(index: int, setting: str) -> tuple[str, list[Any]]:
    return f"{OPTIM}.param_groups.{index}.{setting}", [OPTIM, "param_groups", index, setting]


def own_key(*parts: Any) -> tuple[str, list[Any]]:
    """``rankwise.<parts>``; the parts are names (a rank as "0": ``dcp_to_torch_save`` makes a
    dict of it; an int would make a list, which DCP's loaders then cannot flatten back)."""
    names = [str(p) for p in parts]
    return ".".join([OWN, *names]), [OWN, *names]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r} in a sharded checkpoint",
                          fix="load it with the torch version that wrote it.")  # fmt: skip
    return found


# -- writing --------------------------------------------------------------------------------


def build(items: list[dict[str, Any]], checkpoint_id: str) -> dcp_md.Metadata:
    """torch's ``Metadata`` from every written item: ``key``, ``path``, ``kind`` ('t' tensor,
    'b' bytes), for tensors ``dtype``/``shape``/``offsets``/``sizes``, and where it lies
    (``file``, ``offset``, ``length``)."""
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    for it in sorted(items, key=lambda i: (i["key"], i.get("offsets") or [])):
        key = it["key"]
        planner[key] = tuple(it["path"])
        where = _fs()._StorageInfo(it["file"], it["offset"], it["length"])
        if it["kind"] == "b":
            entries[key] = _md().BytesStorageMetadata()
            storage[_md().MetadataIndex(key)] = where
            continue
        entry = entries.setdefault(key, _md().TensorStorageMetadata(
            properties=_md().TensorProperties(dtype=dtype_of(it["dtype"])),
            size=torch.Size(it["shape"]), chunks=[],
        ))  # fmt: skip
        offsets = torch.Size(it["offsets"])
        entry.chunks.append(_md().ChunkStorageMetadata(offsets, torch.Size(it["sizes"])))
        storage[_md().MetadataIndex(key, offsets)] = where
    return _md().Metadata(
        state_dict_metadata=entries,
        planner_data=planner,
        storage_data=storage,
        storage_meta=_md().StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())),
        version=getattr(_fs(), "CURRENT_DCP_VERSION", "1.0.0"),
    )


def dumps(metadata: dcp_md.Metadata) -> bytes:
    return pickle.dumps(metadata)


# -- reading --------------------------------------------------------------------------------


class _MetadataUnpickler(RestrictedUnpickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file)
        md = _md()  # here, not at import (_md)
        self.BUILD_TYPES = (md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata,
                            md.ChunkStorageMetadata, md.TensorProperties, md.MetadataIndex,
                            md.StorageMeta, _fs()._StorageInfo)  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        ):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(folder: Path, data: bytes | None = None) -> dcp_md.Metadata:
    """The checkpoint's ``Metadata``, unpickling DCP's metadata classes only (``BUILD`` on
    their instances only), then checked: storage entries name files inside the folder, every
    tensor's chunks tile it exactly, every chunk and object has its storage entry. A file that
    names anything else, or does not parse, is a ``ConfigError`` naming it."""
    path = folder / METADATA
    if data is None:
        data = untrusted.read_capped(path, MAX_METADATA_BYTES, "DCP metadata")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise ConfigError(
            f"{os.fspath(path)!r} names {exc}, which DCP metadata never holds; unpickling it "
            "could run code or change a class, so it is refused",
            fix="load only checkpoints written by torch.distributed.checkpoint or rankwise.",
        ) from None
    except Exception as exc:  # whatever the allowed classes raise on a malformed state
        raise ConfigError(
            f"cannot read {os.fspath(path)!r}: {type(exc).__name__}: {str(exc)[:200]}",
            fix="the folder is not a complete DCP checkpoint; load an earlier one.",
        ) from None
    _check_metadata(md, path)
    return md


def _check_metadata(md: Any, path: Path) -> None:
    try:
        bad = _why_malformed(md)
    except (AttributeError, TypeError, ValueError) as exc:  # an object BUILD never filled
        bad = f"is malformed ({type(exc).__name__}: {str(exc)[:120]})"
    if bad:
        raise ConfigError(f"{os.fspath(path)!r} {bad}",
                          fix="load only checkpoints written by torch.distributed.checkpoint "
                          "or rankwise.")  # fmt: skip


def _why_malformed(md: Any) -> str | None:
    if not (isinstance(md, _md().Metadata) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):  # fmt: skip
        return "is not DCP Metadata"
    for index, info in md.storage_data.items():
        if why := _bad_storage(index, info):
            return why
    for key, entry in md.state_dict_metadata.items():
        if why := _bad_entry(key, entry):
            return why
    return _missing_storage(md)


def _bad_storage(index: Any, info: Any) -> str | None:
    """Why a ``storage_data`` entry (where an item's bytes are) is not DCP's, or None."""
    name = info.relative_path if isinstance(info, _fs()._StorageInfo) else None
    where = (getattr(info, "offset", None), getattr(info, "length", None))
    offset = getattr(index, "offset", ())
    if not (isinstance(index, _md().MetadataIndex) and isinstance(name, str)
            and isinstance(index.fqn, str) and (offset is None or isinstance(offset, torch.Size))
            and all(type(n) is int and n >= 0 for n in where)):  # fmt: skip
        return "holds a malformed storage entry"
    if not name or name != Path(name).name or name in (".", "..", METADATA, MANIFEST):
        return f"names {name!r}, which is not a file inside the folder"
    if getattr(info, "transform_descriptors", None):
        return (f"stores {index.fqn!r} through the storage extensions "
                f"{info.transform_descriptors!r}, which rankwise does not read")  # fmt: skip
    return None


def _bad_entry(key: Any, entry: Any) -> str | None:
    """Why a ``state_dict_metadata`` entry is not DCP's, or None."""
    if not isinstance(key, str):
        return "holds a key that is not a string"
    if isinstance(entry, _md().BytesStorageMetadata):
        return None
    if not isinstance(entry, _md().TensorStorageMetadata):
        return f"describes {key!r} with something other than DCP's storage metadata"
    dims = len(entry.size) if isinstance(entry.size, torch.Size) else -1
    dtype = getattr(entry.properties, "dtype", None)
    chunks_ok = isinstance(entry.chunks, list) and all(
        isinstance(c, _md().ChunkStorageMetadata)
        and isinstance(c.offsets, torch.Size) and isinstance(c.sizes, torch.Size)
        and len(c.offsets) == len(c.sizes) == dims
        for c in entry.chunks
    )  # fmt: skip
    if dims < 0 or not isinstance(dtype, torch.dtype) or not chunks_ok:
        return f"describes {key!r} with a malformed shape, dtype or chunk list"
    boxes = [Box(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
    why = tiling_problem(tuple(entry.size), boxes)
    return None if why is None else f"says {key!r} (shape {list(entry.size)}) {why}"


def _missing_storage(md: dcp_md.Metadata) -> str | None:
    """Why some chunk or object of ``md`` has no storage entry (where its bytes are), or None."""
    for key, entry in md.state_dict_metadata.items():
        wanted = ([_md().MetadataIndex(key, c.offsets) for c in entry.chunks]
                  if isinstance(entry, _md().TensorStorageMetadata)
                  else [_md().MetadataIndex(key)])  # fmt: skip
        for index in wanted:
            if index not in md.storage_data:
                at = "" if index.offset is None else f" chunk at {list(index.offset)}"
                return f"lists {key!r}{at} without saying where its bytes are"
    return None


def is_sharded(path: Path) -> bool:
    """True for a folder holding a DCP checkpoint (its ``.metadata``; a ``.metadata`` that is
    not a regular file is refused by name when the folder is read, not taken for something
    else)."""
    return path.is_dir() and os.path.lexists(path / METADATA)
