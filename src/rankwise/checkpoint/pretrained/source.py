"""Where a pretrained model's tensors are: one safetensors file, or a folder with Hugging
Face's ``model.safetensors.index.json`` and its shard files. Everything is validated before a
byte of a tensor is read, and the files are untrusted input:

- safetensors only (no pickle: a ``pytorch_model.bin`` is refused with the conversion to do);
- each file's header is parsed by safetensors itself (bounded size, offsets that cover the
  file exactly): a truncated or corrupt file is a ``ConfigError`` naming it;
- the index is JSON of a bounded size, a map of names to plain file names inside its folder
  (no ``../``, no absolute path), each shard present and holding the tensors the index
  assigns to it;
- every file read from a folder is a regular file (a FIFO would block the open in native
  code) inside it once links are followed, or in the ``blobs`` of the Hugging Face cache
  repository the folder is a snapshot of (``untrusted``).

Tensors are read one at a time (``Source.slice``): the file is opened for that tensor and closed
after, so the memory map's pages this rank touched are released at once.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError
from .. import untrusted

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20
"""An index names every tensor once: a few MB for the largest models. More is not an index."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
"""safetensors' dtype names -> torch's (the ones a model's parameters and buffers use)."""

_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: where it is, its shape and its dtype (as in the file)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def _corrupt(file: Path, exc: BaseException) -> ConfigError:
    return ConfigError(
        f"{os.fspath(file)!r} is not a readable safetensors file (truncated or corrupt?): "
        f"{type(exc).__name__}: {exc}",
        fix="download or save it again (model.save_pretrained(dir) writes safetensors); "
        "compare its size with the source's.",
    )


def read_header(file: Path) -> dict[str, Entry]:
    """Every tensor of one safetensors file, from its header (validated by safetensors)."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(file), framework="pt") as f:
            out = {}
            for key in f.keys():  # noqa: SIM118 (a safe_open, not a dict)
                piece = f.get_slice(key)
                out[key] = Entry(file, tuple(piece.get_shape()), piece.get_dtype())
            return out
    except FileNotFoundError:
        raise ConfigError(
            f"no file {os.fspath(file)!r}",
            fix="pass a .safetensors file, or a folder holding model.safetensors or "
            f"{INDEX} and its shards.",
        ) from None
    except Exception as exc:  # safetensors' SafetensorError (header, offsets), OSError
        raise _corrupt(file, exc) from exc


def _plain_name(folder: Path, name: Any, index: Path) -> Path:
    """``name`` from an index, as a file inside ``folder``; a ConfigError for anything else."""
    if isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name:
        return folder / name
    raise ConfigError(
        f"{os.fspath(index)!r} names the shard file {str(name)[:120]!r} "
        f"({type(name).__name__}), which is not a plain file name inside {os.fspath(folder)!r}",
        fix="an index names its shards by bare file name (model-00001-of-00002.safetensors) "
        "next to it; save the model again, or fix the index by hand if you trust it.",
    )


def _cache_blobs(folder: Path) -> tuple[Path, ...]:
    """Where else a file of ``folder`` may lie once links are followed: Hugging Face's cache
    links ``<repo>/snapshots/<revision>/<file>`` to ``<repo>/blobs/<hash>``."""
    return (folder.parent.parent / "blobs",) if folder.parent.name == "snapshots" else ()


def _member(folder: Path, path: Path, what: str) -> Path:
    """``path``, a file of the model's folder: inside it (or its cache's blobs), regular."""
    untrusted.inside(path, folder, what, also=_cache_blobs(folder))
    untrusted.regular(path, what)
    return path


def read_index(index: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from HF's ``model.safetensors.index.json`` (validated)."""
    raw = untrusted.read_capped(index, MAX_INDEX_BYTES, "safetensors index")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(
            f"{os.fspath(index)!r} is not a readable index (JSON): {type(exc).__name__}: {exc}",
            fix="save the model again, or pass one .safetensors file.",
        ) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise ConfigError(
            f"{os.fspath(index)!r} has no 'weight_map' of tensor names to shard files",
            fix='an index is {"metadata": {...}, "weight_map": {"name": "file"}}; save '
            "the model again with save_pretrained.",
        )
    out = {key: _plain_name(index.parent, name, index) for key, name in weight_map.items()}
    for file in set(out.values()):
        _member(index.parent, file, "shard file")
    return out


def _files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The files to read, and the index's assignment (None for a single file)."""
    if path.is_dir():
        if os.path.lexists(path / INDEX):
            return _files(_member(path, path / INDEX, "safetensors index"))
        if os.path.lexists(path / SINGLE):
            return [_member(path, path / SINGLE, "safetensors file")], None
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if len(found) == 1:
            return [_member(path, path / found[0], "safetensors file")], None
        pickles = sorted({p.name for pattern in _PICKLES for p in path.glob(pattern)})
        hint = (
            f" It holds {pickles[:4]}: pickle files, which rankwise never loads (loading one can "
            "run code)."
            if pickles
            else f" It holds {found[:4] or 'no .safetensors file'}."
        )
        raise ConfigError(
            f"{os.fspath(path)!r} has neither {SINGLE} nor {INDEX}.{hint}",
            fix="save the model with save_pretrained (safetensors), or convert it once in a "
            "process you trust: safetensors.torch.save_file(torch.load(f, weights_only=True), "
            "'model.safetensors').",
        )
    if path.name.endswith(".json"):
        assignment = read_index(path)
        return sorted(set(assignment.values())), assignment
    if path.suffix != ".safetensors":
        raise ConfigError(
            f"{os.fspath(path)!r} is not a .safetensors file or a folder",
            fix="pass a .safetensors file or the folder save_pretrained wrote; pickle-based "
            "files (.bin, .pt) are not loaded (loading one can run code).",
        )
    if os.path.lexists(path):  # a FIFO would block safetensors' open, in native code
        untrusted.regular(path, "safetensors file")
    return [path], None


class Source:
    """The checkpoint's tensors (``entries``: name -> ``Entry``), read one slice at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files, assignment = _files(self.path)
        headers = {file: read_header(file) for file in self.files}
        if assignment is None:
            self.entries = headers[self.files[0]]
            return
        self.entries = {}
        for key, file in assignment.items():
            if key not in headers[file]:
                raise ConfigError(
                    f"{os.fspath(self.path)!r} says tensor {key!r} is in {file.name}, which "
                    f"does not hold it ({len(headers[file])} tensors there)",
                    fix="the index and its shards come from different saves: download or save "
                    "the model again.",
                )
            self.entries[key] = headers[file][key]

    @contextlib.contextmanager
    def reader(self, key: str) -> Iterator[Callable[[tuple], torch.Tensor]]:
        """``read(index)`` for tensor ``key``: safetensors' lazy slice, indexed (only what the
        index names is read). The file is opened for this tensor and closed after."""
        from safetensors import safe_open

        entry = self.entries[key]
        try:
            held = [safe_open(os.fspath(entry.file), framework="pt")]
            held.append(held[0].get_slice(key))
        except Exception as exc:
            raise _corrupt(entry.file, exc) from exc

        def read(index: tuple) -> torch.Tensor:
            try:
                return held[1][index]
            except Exception as exc:
                raise _corrupt(entry.file, exc) from exc

        try:
            yield read
        finally:
            held.clear()  # unmaps the file: the pages this rank touched leave its memory
