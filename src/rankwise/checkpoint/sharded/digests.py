"""Checksums of a sharded checkpoint's files: xxh3 (``xxhash``), at tens of GB/s per core.

Every shard file gets an ``xxh3_128`` of its whole content and every item in it (one tensor
chunk or one object) an ``xxh3_64`` of its bytes, both computed while the bytes are written
(``HashingWriter``: no second pass) and listed in the checkpoint's ``rankwise.json``. A load
checks each item it reads before torch parses it (``read_item``), so a flipped byte anywhere a
rank reads is a ``ConfigError`` naming the file; ``rankwise checkpoint inspect`` checks whole
files. Like CRC-32 they catch accidents of disks and copies, not deliberate edits.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any

import xxhash

from ...errors import ConfigError

FILE_DIGEST = "xxh3_128"
ITEM_DIGEST = "xxh3_64"
_BLOCK = 8 << 20
_SLICE = 1 << 20
"""Bytes hashed at a time while writing: as large as a core's L2 cache here (1 MiB), so a
slice is hashed while it is still in cache (the whole tensor at once took twice as long)."""


class HashingWriter(io.RawIOBase):
    """A write-only stream over ``raw`` that hashes everything written (the file's digest)
    and, between ``begin_item``/``end_item``, the current item's too."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self.raw = raw
        self.file_hash = xxhash.xxh3_128()
        self.item_hash: Any = None
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        # A slice at a time: the copy reads it from memory, both hashes find it in the cache
        # (a 64 MiB tensor in three whole passes took twice as long, and its memory traffic
        # slowed the training steps a background save overlaps).
        for start in range(0, len(view), _SLICE):
            piece = view[start : start + _SLICE]
            self.raw.write(piece)
            self.file_hash.update(piece)
            if self.item_hash is not None:
                self.item_hash.update(piece)
        self.position += len(view)
        return len(view)

    def tell(self) -> int:
        return self.position

    def begin_item(self) -> int:
        self.item_hash = xxhash.xxh3_64()
        return self.position

    def end_item(self) -> str:
        digest, self.item_hash = self.item_hash.hexdigest(), None
        return digest


class FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable read-only stream
    (what ``torch.load`` reads one item from, without copying the item into memory first)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        want = min(len(buf), self.length - self.pos)
        if want <= 0:
            return 0
        got = os.preadv(self.fd, [memoryview(buf)[:want]], self.offset + self.pos)
        self.pos += got
        return got

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


def range_digest(fd: int, offset: int, length: int) -> str:
    """``xxh3_64`` of ``length`` bytes at ``offset`` of an open file (fewer if the file ends
    first). Read through one buffer, allocated once per call: a new 8 MiB block per read cost
    a verified load a third of its time (a fresh allocation is mapped and faulted in anew)."""
    h = xxhash.xxh3_64()
    block = memoryview(bytearray(min(_BLOCK, length)))
    done = 0
    while done < length:
        got = os.preadv(fd, [block[: length - done]], offset + done)
        if got <= 0:
            break
        h.update(block[:got])
        done += got
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """``xxh3_128`` of a whole file."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_BLOCK):
            h.update(chunk)
    return h.hexdigest()


def damaged(path: Path, what: str, got: str, want: str) -> ConfigError:
    """The error for bytes that do not match their recorded checksum."""
    return ConfigError(
        f"sharded checkpoint file {os.fspath(path)!r} is damaged: {what} has checksum {got}, "
        f"{want} was written",
        fix="load an earlier checkpoint (rw.list_checkpoints(folder) lists them) or copy the "
        "folder again; `rankwise checkpoint inspect FOLDER` checks every file.",
    )
