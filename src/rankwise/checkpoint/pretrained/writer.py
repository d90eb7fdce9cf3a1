"""Safetensors files written tensor by tensor, in a temporary folder renamed into place.

safetensors' own writers take a dict of every tensor at once; an export that must never hold
the whole model writes the format itself: its header only needs each tensor's name, dtype and
shape, known before any tensor is gathered, so the header goes first and each tensor's bytes
follow as they arrive. The format (8-byte little-endian header length; a JSON header of
``name -> {dtype, shape, data_offsets}`` plus ``__metadata__``, padded with spaces to 8 bytes;
the tensors' bytes, back to back) is read back by safetensors itself in the tests.

Files are split like Hugging Face's ``save_pretrained``: ``model.safetensors`` when everything
fits ``max_shard_size``, else ``model-00001-of-0000N.safetensors`` with
``model.safetensors.index.json``. The folder is built as ``.<name>.<random>.tmp`` beside the
target and renamed into place at the end: a reader sees the old folder or the new, never a mix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from ...errors import ConfigError
from ..files import _fsync_dir, glob_escape
from .source import DTYPES, INDEX, SINGLE

NAMES = {dtype: name for name, dtype in DTYPES.items()}
"""torch dtype -> safetensors' name."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*$", re.I)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """``max_shard_size``: bytes, or ``"5GB"``/``"500MB"``/``"2GiB"`` as Hugging Face spells it."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE.match(size) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(
            f"max_shard_size={size!r} is not a size",
            fix="pass a positive number of bytes or a string such as '5GB', '500MB', '2GiB'.",
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class Item:
    """One tensor of the export, as it will be in the file."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def shard_files(items: Sequence[Item], max_bytes: int) -> list[list[Item]]:
    """Items cut into files of at most ``max_bytes`` each (a larger tensor alone), in order."""
    files: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if files[-1] and size + item.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += item.nbytes
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header(items: Sequence[Item]) -> bytes:
    """The header of a file holding ``items`` in this order (length prefix included)."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        meta[item.key] = {"dtype": NAMES[item.dtype], "shape": list(item.shape),
                          "data_offsets": [offset, offset + item.nbytes]}  # fmt: skip
        offset += item.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
    return len(text).to_bytes(8, "little") + text


CHUNK_BYTES = 16 << 20
"""Bytes copied out of a tensor per write (its own buffer: a model tensor's storage is never
handed to numpy, which would pin it, and ZeRO-3 frees its units by resizing their storage)."""


def write_tensor(f: IO[bytes], tensor: torch.Tensor) -> None:
    """A tensor's bytes, little-endian, in C order, through a buffer of ``CHUNK_BYTES``."""
    if sys.byteorder != "little":  # pragma: no cover - no such machine runs torch today
        raise ConfigError("safetensors files are little-endian; this machine is not",
                          fix="export on a little-endian machine.")  # fmt: skip
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return
    step = max(1, CHUNK_BYTES // flat.element_size())
    buffer = torch.empty(min(n, step), dtype=flat.dtype)
    for start in range(0, n, step):
        piece = buffer[: min(step, n - start)]
        piece.copy_(flat[start : start + len(piece)])
        f.write(memoryview(piece.view(torch.uint8).numpy()))


def swap_into_place(built: Path, target: Path, ours: set[str]) -> None:
    """Rename the folder ``built`` to ``target``. An existing ``target`` keeps the files we do
    not write (a tokenizer saved beside the model): they are linked into ``built`` first, and
    the old folder is removed once the new one is in place."""
    if not target.exists():
        os.replace(built, target)
    else:
        if not target.is_dir():
            raise ConfigError(
                f"{os.fspath(target)!r} exists and is not a folder",
                fix="pass a folder path for the export (save_pretrained writes several files).",
            )
        for entry in target.iterdir():
            stale = entry.name in ours or re.match(
                r"model.*\.safetensors(\.index\.json)?$", entry.name
            )
            if stale or (built / entry.name).exists():
                continue
            _carry(entry, built / entry.name)
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, old / target.name)
        os.replace(built, target)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)


def _carry(src: Path, dst: Path) -> None:
    """Hard-link (or copy) a file or folder that an earlier save left beside the model."""
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def new_folder(target: Path) -> Path:
    """An empty temporary folder beside ``target`` (leftovers of killed exports removed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob_escape(target.name)}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))


def write_index(folder: Path, files: Sequence[Sequence[Item]], names: Sequence[str]) -> None:
    total = sum(i.nbytes for f in files for i in f)
    params = sum(i.nbytes // i.dtype.itemsize for f in files for i in f)
    weight_map = {i.key: name for f, name in zip(files, names, strict=True) for i in f}
    index = {"metadata": {"total_parameters": params, "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}  # fmt: skip
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
