"""Write a ``torch.save`` file one tensor at a time (``rankwise checkpoint consolidate``).

``torch.save`` needs every tensor in memory at once. This writes the same zip archive torch
does, a record per storage beside the pickled structure (``data.pkl``), but asks for each
tensor's data only when its record is written: the structure names placeholders
(``TensorRef``) that pickle exactly as torch pickles a tensor (``_rebuild_tensor_v2`` of a
storage named by key), and ``write`` calls ``fill(ref)`` for each in turn. The records are
stored uncompressed, 64-byte aligned, with their CRC-32, so ``torch.load`` (also with
``mmap=True`` and ``weights_only=True``) and ``rw.load_checkpoint`` read the file as one
``torch.save`` wrote.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import torch

_ALIGN = 64
_ARCHIVE = "archive"


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


class TensorRef:
    """A tensor of ``shape``/``dtype`` whose data ``write`` asks for when it gets there."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key, self.shape, self.dtype = key, tuple(shape), dtype
        self.numel = 1
        for s in self.shape:
            self.numel *= s

    def __reduce__(self) -> Any:
        stride = torch.empty(self.shape, device="meta").stride() if self.shape else ()
        storage = _StorageRef(self.key, self.dtype, self.numel)
        return (torch._utils._rebuild_tensor_v2,
                (storage, 0, self.shape, stride, False, collections.OrderedDict()))  # fmt: skip


def _storage_type(dtype: torch.dtype) -> Any:
    with warnings.catch_warnings():  # the name torch itself pickles, e.g. torch.FloatStorage
        warnings.simplefilter("ignore")
        name = torch.TypedStorage(0, dtype=dtype, device="meta").pickle_storage_type()
    return getattr(torch, name)


class _Pickler(pickle.Pickler):
    """Pickles placeholders as torch's storages; real tensors' storages are kept to write."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, protocol=2)
        self.real: dict[str, torch.UntypedStorage] = {}
        self.count = 0

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            key = f"r{len(self.real)}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                untyped = obj._untyped_storage.cpu()
                numel = untyped.nbytes() // obj.element_size()
                self.real[key] = untyped
                return ("storage", _storage_type(obj.dtype), key, "cpu", numel)
        return None


class _Zip:
    def __init__(self, file: IO[bytes]) -> None:
        self.zip = zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True)

    def record(self, name: str, size: int, chunks: Any) -> None:
        info = zipfile.ZipInfo(f"{_ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.file_size = size
        zip64 = size > zipfile.ZIP64_LIMIT
        start = self.zip.fp.tell() + 30 + len(info.filename.encode()) + 4 + (20 if zip64 else 0)
        pad = (-start) % _ALIGN
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch's padding field id
        with self.zip.open(info, "w", force_zip64=zip64) as out:
            for chunk in chunks:
                out.write(chunk)

    def close(self) -> None:
        self.zip.close()


def _bytes_of(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def write(
    file: IO[bytes], obj: Any, refs: list[TensorRef], fill: Callable[[TensorRef], torch.Tensor]
) -> None:
    """``torch.save(obj, file)`` where each ``TensorRef`` in ``obj`` is ``fill(ref)``, asked
    for one at a time, in ``refs`` order (the caller may free it as soon as it returns)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    out = _Zip(file)
    pkl = buf.getvalue()
    out.record("data.pkl", len(pkl), [pkl])
    out.record("byteorder", 6, [b"little"])
    for ref in refs:
        t = fill(ref)
        if tuple(t.shape) != ref.shape or t.dtype != ref.dtype:
            raise ValueError(f"{ref.key}: got {tuple(t.shape)} {t.dtype}, expected {ref.shape} "
                             f"{ref.dtype}")  # fmt: skip
        data = _bytes_of(t)
        out.record(f"data/{ref.key}", len(data), [data])
        del t, data
    for key, storage in pickler.real.items():
        data = memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
        out.record(f"data/{key}", len(data), [data])
    out.record("version", 2, [b"3\n"])
    out.close()
