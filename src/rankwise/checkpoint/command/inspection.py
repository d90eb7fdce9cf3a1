"""``rankwise checkpoint inspect DIR``: what a sharded checkpoint holds, read from its metadata.

Keys with their full shapes, dtypes, chunk counts and sizes; the world size, mesh, strategy and
step it was saved at (``rankwise.json``; a checkpoint torch's ``dcp.save`` wrote has none);
every file's size and whether its ``xxh3_128`` checksum still matches (``verify=False`` skips
reading the files). Nothing is loaded but the metadata, read without running code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import metadata as dcp_md

from ...errors import ConfigError
from ..sharded import dcp_meta, digests
from ..sharded.boxes import numel
from ..sharded.read import Reader

_META = ("step", "epoch", "world_size", "mesh", "strategy", "engine", "model_class",
         "rankwise_version", "torch_version", "saved_at")  # fmt: skip


def inspect(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """A JSON-ready description of the sharded checkpoint at ``path`` (or its ``latest``)."""
    from ..api import resolve

    folder = resolve(path)
    if not dcp_meta.is_sharded(folder):
        raise ConfigError(f"{os.fspath(path)!r} is not a sharded checkpoint (no .metadata)",
                          fix="pass a sharded checkpoint's folder, or a folder of them.")  # fmt: skip
    with Reader(folder) as reader:
        manifest = reader.manifest or {}
        tensors, objects = [], []
        for key, entry in sorted(reader.entries.items()):
            if isinstance(entry, dcp_md.TensorStorageMetadata):
                dtype = entry.properties.dtype
                tensors.append({
                    "key": key, "shape": list(entry.size), "dtype": dcp_meta.dtype_name(dtype),
                    "chunks": len(entry.chunks), "bytes": numel(entry.size) * dtype.itemsize,
                })  # fmt: skip
            else:
                objects.append(key)
        listed = {info.relative_path for info in reader.md.storage_data.values()}
    out_files = [_file(folder, name, manifest, verify) for name in sorted(listed)]
    states = {f["checksum"] for f in out_files}
    return {
        "path": os.fspath(folder),
        "written_by": "rankwise" if manifest else "another tool (no rankwise.json)",
        **{k: manifest.get(k) for k in _META},
        "tensors": tensors,
        "objects": objects,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "files": out_files,
        "checksums": "damaged" if states & {"damaged", "missing"} else sorted(states)[0]
        if len(states) == 1 else "mixed",
    }  # fmt: skip


def _file(folder: Path, name: str, manifest: dict[str, Any], verify: bool) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        return {"name": name, "bytes": None, "checksum": "missing"}
    size = path.stat().st_size
    want = manifest.get("files", {}).get(name, {}).get(digests.FILE_DIGEST)
    if want is None:
        state = "none recorded"
    elif not verify:
        state = "not checked"
    else:
        state = "ok" if digests.file_digest(path) == want else "damaged"
    return {"name": name, "bytes": size, "checksum": state}


def format_text(info: dict[str, Any]) -> str:
    """The human-readable report of ``inspect``."""
    lines = [f"sharded checkpoint {info['path']} (written by {info['written_by']})"]
    for k in ("step", "epoch", "world_size", "mesh", "strategy", "engine", "model_class"):
        if info.get(k) is not None:
            lines.append(f"  {k.replace('_', ' ')}: {info[k]}")
    lines.append(f"  tensors: {len(info['tensors'])}, {info['tensor_bytes'] / 2**20:.1f} MiB; "
                 f"objects: {len(info['objects'])}; checksums: {info['checksums']}")  # fmt: skip
    width = max((len(t["key"]) for t in info["tensors"]), default=3)
    lines.append("")
    lines.append(f"{'key':<{width}}  {'shape':<18} {'dtype':<9} {'chunks':>6} {'MiB':>9}")
    for t in info["tensors"]:
        shape = "x".join(map(str, t["shape"])) or "scalar"
        lines.append(f"{t['key']:<{width}}  {shape:<18} {t['dtype']:<9} {t['chunks']:>6} "
                     f"{t['bytes'] / 2**20:>9.3f}")  # fmt: skip
    lines.append("")
    lines.append(f"{'file':<20} {'bytes':>14}  checksum")
    for f in info["files"]:
        size = "-" if f["bytes"] is None else str(f["bytes"])
        lines.append(f"{f['name']:<20} {size:>14}  {f['checksum']}")
    return "\n".join(lines)
