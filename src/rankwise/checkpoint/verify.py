"""Checking a checkpoint's bytes on load: its zip structure, then every record.

``torch.save`` writes a zip whose every record (the pickled structure, each tensor's storage)
carries a CRC-32, and ``torch.load`` checks neither them nor the zip's directory: a flipped
byte inside a tensor loads as a wrong weight, a flipped bit in the directory can load
uninitialised memory. ``Verifier`` first reads the structure as torch's reader does and refuses
whatever could be read otherwise than written (``zipcheck``), then checks every record: against
the digests ``rw.save_checkpoint`` writes into the file (``sums``: XXH3 over each record's local
header and data), or against the zip's CRC-32 in files without them (older checkpoints, plain
``torch.save``). The records are checked in threads while ``torch.load`` reads the same file
(``xxhash`` and ``zlib.crc32`` release the GIL), so a verified load costs little more wall time
than a plain one (``benchmarks/checkpoint_verify.py``). A mismatch is a ``ConfigError`` naming
the file and the record. Files in torch's legacy (non-zip) format carry neither and are not
checked.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO

from . import sums, zipcheck
from .zipcheck import Entry, corrupt

Record = Entry  # the name earlier code used
__all__ = ["Record", "Verifier", "corrupt", "crc32_combine", "records", "save"]

_CHUNK = 8 * 1024 * 1024
_PIECE = 64 * 1024 * 1024  # large records are split so that every thread has work
_TASK = 8 * 1024 * 1024  # small records are grouped into tasks of at least this many bytes


def records(file: Path | str | os.PathLike) -> list[Entry]:
    """The records of a ``torch.save`` zip, checked by ``zipcheck`` ([] if not a zip)."""
    path = Path(file)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return zipcheck.entries(view, path)
            finally:
                view.release()


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
    """``torch.save(obj, f)`` plus the digest manifest (``sums``). ``f`` is a file
    whose descriptor is open for reading and writing (``files.write_atomic``'s)."""
    import torch

    torch.save(obj, f)
    f.flush()
    sums.add_manifest(f.fileno(), _records_of(f))
    f.seek(0, os.SEEK_END)  # the file grew behind this object's back


def _records_of(f: IO[bytes]) -> list[Entry]:
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return zipcheck.entries(view, Path(str(getattr(f, "name", "<file>"))))
        finally:
            view.release()


class Verifier:
    """``Verifier(file)`` checks the zip structure at once (``ConfigError`` if damaged), then
    starts checking every record in threads; ``check()`` waits and raises.

    Use it around ``torch.load`` of the same file: the two read it concurrently.
    """

    def __init__(self, file: Path, threads: int | None = None) -> None:
        self.file = file
        self._map: mmap.mmap | None = None
        self._view = memoryview(b"")
        try:
            with open(file, "rb") as f:
                if os.fstat(f.fileno()).st_size:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # unreadable or cannot map: torch.load names the problem
            self._map = None
        if self._map is not None:
            self._view = memoryview(self._map)
        self._pool: ThreadPoolExecutor | None = None
        self._tasks: list[tuple[list[tuple[int, int, int]], Future | None]] = []
        try:
            self.records = zipcheck.entries(self._view, file)
            self._sums = self._manifest()
        except BaseException:
            self.close()
            raise
        if len(self._view) >= _TASK:  # a small file is checked in check(), without threads
            self._pool = ThreadPoolExecutor(threads or sums.threads_default(), "rankwise-verify")
        self._submit()

    def _manifest(self) -> dict[str, tuple[int, str]] | None:
        """The digests written at save; None where there are none (or of an older algorithm):
        then the zip's CRC-32 is checked. A damaged manifest is itself an error."""
        found = [r for r in self.records if sums.is_manifest(r.name)]
        if not found:
            return None
        r = found[0]
        if r is not self.records[-1]:
            raise corrupt(self.file, r.name, "(the digests written at save) is not the last record")
        data = bytes(self._view[r.data_offset : r.data_offset + r.size])
        if zlib.crc32(data) != r.crc:
            raise corrupt(self.file, r.name, "(the digests written at save) is damaged")
        try:
            return sums.parse(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise corrupt(self.file, r.name, f"cannot be read ({exc})") from None

    def _ranges(self, r: Entry) -> list[tuple[int, int]]:
        """What is checked of a record: with digests, its local header and data; else its data."""
        if self._sums is not None:
            return sums.pieces(r.header_offset, r.data_offset + r.size - r.header_offset)
        return _pieces(r)

    def _submit(self) -> None:
        """Queue every record's pieces, several small ones per task (a thread handoff costs more
        than hashing a few kilobytes; a checkpoint may hold thousands of small tensors)."""
        fn = sums.piece_digest if self._sums is not None else _crc_piece
        group: list[tuple[int, int, int]] = []
        size = 0
        for i, r in enumerate(self.records):
            if sums.is_manifest(r.name):
                continue  # checked above, by its CRC
            for a, b in self._ranges(r):
                group.append((i, a, b))
                size += b - a
                if size >= _TASK:
                    self._queue(fn, group)
                    group, size = [], 0
        if group:
            self._queue(fn, group)

    def _queue(self, fn: Callable[[memoryview, int, int], int], group: list) -> None:
        if self._pool is None:
            self._tasks.append((group, None))
        else:
            self._tasks.append((group, self._pool.submit(_run, fn, self._view, group)))

    def check(self) -> None:
        """Wait for every record; raise ``ConfigError`` naming the first that does not match."""
        try:
            done: dict[int, list[tuple[int, int]]] = {}
            fn = sums.piece_digest if self._sums is not None else _crc_piece
            for group, future in self._tasks:
                values = _run(fn, self._view, group) if future is None else future.result()
                for (i, a, b), value in zip(group, values, strict=True):
                    done.setdefault(i, []).append((b - a, value))
            for i, pieces in sorted(done.items()):
                if self._sums is not None:
                    self._check_digest(self.records[i], pieces)
                else:
                    self._check_crc(self.records[i], pieces)
            held = {r.name for r in self.records}
            for name in self._sums or {}:
                if name not in held:
                    raise corrupt(self.file, name, "is missing (the file's digests list it)")
        finally:
            self.close()

    def _check_digest(self, record: Entry, pieces: list[tuple[int, int]]) -> None:
        assert self._sums is not None
        if record.name not in self._sums:
            raise corrupt(self.file, record.name, "is not listed in the digests written at save")
        size, expected = self._sums[record.name]
        if size != record.size:
            raise corrupt(
                self.file, record.name, f"holds {record.size} bytes, not the {size} written"
            )
        got = sums.combine((value for _, value in pieces), sum(n for n, _ in pieces))
        if got != expected:
            raise corrupt(
                self.file,
                record.name,
                f"has checksum {sums.ALGORITHM} {got}, not the {expected} written with it",
            )

    def _check_crc(self, record: Entry, pieces: list[tuple[int, int]]) -> None:
        got = 0
        for length, value in pieces:
            got = crc32_combine(got, value, length)
        if got != record.crc:
            raise corrupt(
                self.file,
                record.name,
                f"has CRC-32 {got:08x}, not the {record.crc:08x} written with it",
            )

    def close(self) -> None:
        for _, future in self._tasks:
            if future is not None:
                future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._view.release()
        if self._map is not None:
            self._map.close()
            self._map = None


def _run(
    fn: Callable[[memoryview, int, int], int], view: memoryview, group: list[tuple[int, int, int]]
) -> list[int]:
    return [fn(view, a, b) for _, a, b in group]
