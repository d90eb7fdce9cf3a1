"""Checking a checkpoint's bytes on load: every record of the file against its zip CRC-32.

``torch.save`` writes a zip whose every record (the pickled structure, each tensor's storage)
carries a CRC-32, and ``torch.load`` does not check them: a flipped byte inside a tensor loads
as a wrong weight. ``Verifier`` recomputes every record's CRC-32 in threads while ``torch.load``
reads the file (``zlib.crc32`` releases the GIL), so a verified load costs little more wall
time than a plain one (``benchmarks/checkpoint_verify.py``). A mismatch is a ``ConfigError``
naming the file and the record. Files without CRCs (torch's legacy format) are not checked.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

_CHUNK = 8 * 1024 * 1024
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_MAGIC = 0x04034B50


@dataclass(frozen=True)
class Record:
    """One stored record of the zip: where its bytes are and the CRC-32 they must have."""

    name: str
    offset: int
    size: int
    crc: int


def records(file: Path) -> list[Record]:
    """The stored records of a ``torch.save`` zip, with their data offsets; [] if not a zip."""
    if not zipfile.is_zipfile(file):
        return []
    out = []
    with zipfile.ZipFile(file) as z, open(file, "rb") as f:
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


def _crc_of(fd: int, record: Record) -> int:
    crc, done, buf = 0, 0, bytearray(min(_CHUNK, max(record.size, 1)))
    view = memoryview(buf)
    while done < record.size:
        n = os.preadv(fd, [view[: min(len(buf), record.size - done)]], record.offset + done)
        if n <= 0:
            return -1  # the file is shorter than its directory says
        crc = zlib.crc32(view[:n], crc)
        done += n
    return crc


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
        self._fd = os.open(file, os.O_RDONLY) if self.records else -1
        workers = threads or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="rankwise-verify")
        # Largest first: a big tensor's record must not start last.
        order = sorted(self.records, key=lambda r: -r.size)
        self._futures: list[tuple[Record, Future]] = [
            (r, self._pool.submit(_crc_of, self._fd, r)) for r in order
        ]

    def check(self) -> None:
        """Wait for every record; raise ``ConfigError`` naming the first that does not match."""
        try:
            for record, future in self._futures:
                got = future.result()
                if got == -1:
                    raise corrupt(self.file, record.name, "is cut short")
                if got != record.crc:
                    raise corrupt(
                        self.file,
                        record.name,
                        f"has CRC-32 {got:08x}, not the {record.crc:08x} written with it",
                    )
        finally:
            self.close()

    def close(self) -> None:
        for _, future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
