"""Checking a checkpoint's bytes on load: every record of the file against its checksum.

``torch.save`` writes a zip whose every record (the pickled structure, each tensor's storage)
carries a CRC-32, and ``torch.load`` does not check them: a flipped byte inside a tensor loads
as a wrong weight. ``rw.save_checkpoint`` also writes a faster checksum per record into the
file (``sums``: a weighted 64-bit sum at memory speed). ``Verifier`` checks every
record against it, or against the zip's CRC-32 in files without it (older checkpoints, plain
``torch.save``), in threads while ``torch.load`` reads the same file (numpy and ``zlib.crc32``
release the GIL), so a verified load costs little more wall time than a plain one
(``benchmarks/checkpoint_verify.py``). A mismatch is a ``ConfigError`` naming the file and the
record. Files in torch's legacy (non-zip) format carry neither and are not checked.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..errors import ConfigError
from . import sums

_CHUNK = 8 * 1024 * 1024
_PIECE = 64 * 1024 * 1024  # large records are split so that every thread has work
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_MAGIC = 0x04034B50


@dataclass(frozen=True)
class Record:
    """One stored record of the zip: where its bytes are and the CRC-32 they must have."""

    name: str
    offset: int
    size: int
    crc: int


def records(file: Path | IO[bytes]) -> list[Record]:
    """The stored records of a ``torch.save`` zip (a path or an open binary file), with their
    data offsets; [] if not a zip."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as f:
            return _records(f, Path(file))
    return _records(file, Path(str(getattr(file, "name", "<file>"))))


def _records(f: IO[bytes], file: Path) -> list[Record]:
    if not zipfile.is_zipfile(f):
        return []
    out = []
    with zipfile.ZipFile(f) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                continue  # torch stores records uncompressed; anything else is not ours to check
            f.seek(info.header_offset)
            header = f.read(_LOCAL_HEADER.size)
            fields = _LOCAL_HEADER.unpack(header) if len(header) == _LOCAL_HEADER.size else None
            if fields is None or fields[0] != _LOCAL_MAGIC:
                raise corrupt(file, info.filename, "its zip header is damaged")
            start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
            out.append(Record(info.filename, start, info.compress_size, info.CRC))
    return out


def corrupt(file: Path, entry: str, why: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {os.fspath(file)!r} is corrupt: record {entry!r} {why}; loading it would "
        "resume from wrong values",
        fix="load an earlier checkpoint (rw.list_checkpoints(folder) lists them) or copy the file "
        "again from a good source; check the disk or the transfer that damaged it.",
    )


def _crc_piece(mapped: memoryview, start: int, end: int) -> int:
    """CRC-32 of ``mapped[start:end]``, read in place from the mapped file (no copy)."""
    crc = 0
    for at in range(start, end, _CHUNK):
        crc = zlib.crc32(mapped[at : min(at + _CHUNK, end)], crc)
    return crc


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's method, which
    Python's zlib does not expose): pieces of one large record are checked in parallel."""
    if len2 == 0:
        return crc1
    # The operator that appends one zero bit to the message, then 2, 4, 8 ... by squaring.
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # 8 bits (one byte), then 32, 128 ...
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def _pieces(record: Record) -> list[tuple[int, int]]:
    """The record cut into ``_PIECE``-byte ranges (one task each)."""
    end = record.offset + record.size
    return [(a, min(a + _PIECE, end)) for a in range(record.offset, end, _PIECE)] or [(end, end)]


def save(obj: object, f: IO[bytes]) -> None:
    """``torch.save(obj, f)`` plus the checksum manifest (``sums``). ``f`` is a file
    whose descriptor is open for reading and writing (``files.write_atomic``'s)."""
    import torch

    torch.save(obj, f)
    f.flush()
    with os.fdopen(os.dup(f.fileno()), "rb") as g:
        written = records(g)
    sums.add_manifest(f.fileno(), written)
    f.seek(0, os.SEEK_END)  # the file grew behind this object's back


class Verifier:
    """``Verifier(file)`` starts checking every record in threads; ``check()`` waits and raises.

    Use it around ``torch.load`` of the same file: the two read it concurrently.
    """

    def __init__(self, file: Path, threads: int | None = None) -> None:
        self.file = file
        try:
            self.records = records(file)
        except (OSError, zipfile.BadZipFile, ValueError):
            self.records = []  # torch.load names the damage; nothing here to compare against
        self._map: mmap.mmap | None = None
        if self.records:
            try:
                with open(file, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # a filesystem that cannot map: load unverified
                self.records = []
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._error: ConfigError | None = None
        self._sums = self._manifest()
        workers = threads or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="rankwise-verify")
        self._futures = [(r, self._submit(r)) for r in self.records]

    def _manifest(self) -> dict[str, tuple[int, int]]:
        """The checksums written at save, {} if none; a damaged manifest is itself an error."""
        found = [r for r in self.records if sums.is_manifest(r.name)]
        if not found:
            return {}
        r = found[0]
        data = bytes(self._view[r.offset : r.offset + r.size])
        if zlib.crc32(data) != r.crc:
            self._error = corrupt(self.file, r.name, "(the checksums written at save) is damaged")
            return {}
        try:
            return sums.parse(data)
        except (ValueError, KeyError, TypeError) as exc:
            self._error = corrupt(self.file, r.name, f"cannot be read ({exc})")
            return {}

    def _submit(self, r: Record) -> list[tuple[int, Future]]:
        if r.offset + r.size > len(self._view):
            return []  # cut short: check() says so
        if r.name in self._sums:
            return [
                (b - a, self._pool.submit(sums.piece_sum, self._view, r.offset, a, b))
                for a, b in sums.pieces(r.offset, r.size)
            ]
        return [(b - a, self._pool.submit(_crc_piece, self._view, a, b)) for a, b in _pieces(r)]

    def check(self) -> None:
        """Wait for every record; raise ``ConfigError`` naming the first that does not match."""
        try:
            if self._error is not None:
                raise self._error
            for record, pieces in self._futures:
                if record.offset + record.size > len(self._view):
                    raise corrupt(self.file, record.name, "is cut short")
                if record.name in self._sums:
                    self._check_sum(record, pieces)
                else:
                    self._check_crc(record, pieces)
            held = {r.name for r in self.records}
            for name in self._sums:
                if name not in held:
                    raise corrupt(self.file, name, "is missing (the file's checksums list it)")
        finally:
            self.close()

    def _check_sum(self, record: Record, pieces: list[tuple[int, Future]]) -> None:
        size, expected = self._sums[record.name]
        if size != record.size:
            raise corrupt(
                self.file, record.name, f"holds {record.size} bytes, not the {size} written"
            )
        got = sum(future.result() for _, future in pieces) & (2**64 - 1)
        if got != expected:
            raise corrupt(
                self.file,
                record.name,
                f"has checksum {sums.ALGORITHM} {got:016x}, not "
                f"the {expected:016x} written with it",
            )

    def _check_crc(self, record: Record, pieces: list[tuple[int, Future]]) -> None:
        got = 0
        for length, future in pieces:
            got = crc32_combine(got, future.result(), length)
        if got != record.crc:
            raise corrupt(
                self.file,
                record.name,
                f"has CRC-32 {got:08x}, not the {record.crc:08x} written with it",
            )

    def close(self) -> None:
        for _, pieces in self._futures:
            for _, future in pieces:
                future.cancel()
        self._pool.shutdown(wait=True)
        self._view.release()
        if self._map is not None:
            self._map.close()
            self._map = None
