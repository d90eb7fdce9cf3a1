"""A position-dependent digest per record, written into the checkpoint at save and checked on load.

The digest is xxHash's XXH3 (64 bits, the ``xxhash`` package) over 64 MiB pieces, combined in
order: ``digest = xxh3_64(xxh3_64(piece 0) || xxh3_64(piece 1) || ... || length)``, each value a
little-endian 64-bit word. XXH3 runs at memory speed (tens of GB/s per core, several times
CRC-32) and releases the GIL on large inputs, so threads check the pieces of a file while
``torch.load`` reads it. Unlike a sum of words it depends on where every byte is: swapped words,
swapped pages or swapped pieces, two flips that cancel in a sum, a zeroed page or a record cut
short all change it (a changed record keeps its digest with probability 2**-64). Like CRC-32 it
guards against accidents of disks, copies and memory, not against someone who edits the file
on purpose (nothing without a secret key does).

``digest(buffer)`` and ``digest_file(path)`` are the function API (sharded checkpoints store one
per file). ``add_manifest`` appends one small record, ``<archive>/.rankwise-sums.json``, to the
zip that ``torch.save`` wrote: for every record, its size and the digest of its bytes *from its
local zip header to the end of its data* (header, name, extra field, data), so that no byte a
reader uses is left out. The other records do not move: ``torch.load`` and ``mmap=True`` loads
read the file as before. A manifest of another algorithm (the earlier ``sum64-1MiB``, a weighted
word sum that missed swapped words, or one a later version may write) is not used: ``parse``
returns None and the file is checked against the zip's CRC-32 instead (``verify``).
"""

from __future__ import annotations

import json
import mmap
import os
import zipfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

MANIFEST = ".rankwise-sums.json"
ALGORITHM = "xxh3_64-64MiB"
"""The manifest's algorithm name: XXH3-64 over 64 MiB pieces, combined in order."""
OLD_ALGORITHMS = ("sum64-1MiB",)
"""Algorithms of earlier manifests: not trusted (the zip's CRC-32 is checked instead)."""
PIECE = 64 << 20  # bytes per piece: one thread task, and part of the digest's definition


def threads_default() -> int:
    return min(8, os.cpu_count() or 1)


def pieces(start: int, size: int) -> list[tuple[int, int]]:
    """``[start, start + size)`` cut into ``PIECE``-byte ranges (at least one, maybe empty)."""
    end = start + size
    return [(a, min(a + PIECE, end)) for a in range(start, end, PIECE)] or [(end, end)]


def piece_digest(view: Any, start: int, end: int) -> int:
    """XXH3-64 of ``view[start:end]``, read in place (no copy; the GIL is released)."""
    return xxhash.xxh3_64_intdigest(view[start:end])


def combine(piece_digests: Iterable[int], length: int) -> str:
    """The digest (16 hex digits) of ``length`` bytes whose pieces had ``piece_digests``."""
    words = b"".join(d.to_bytes(8, "little") for d in piece_digests)
    return f"{xxhash.xxh3_64_intdigest(words + length.to_bytes(8, 'little')):016x}"


def digest(buffer: Any) -> str:
    """The digest of a bytes-like object (bytes, memoryview, numpy array, mmap), as 16 hex
    digits: what the manifest stores per record and ``digest_file`` gives for a whole file."""
    view = memoryview(buffer).cast("B")
    try:
        return combine((piece_digest(view, a, b) for a, b in pieces(0, len(view))), len(view))
    finally:
        view.release()


def digest_ranges(
    view: Any, ranges: list[tuple[int, int]], threads: int | None = None
) -> list[str]:
    """The digest of each ``(start, end)`` range of ``view``, pieces computed in threads."""
    with ThreadPoolExecutor(threads or threads_default()) as pool:
        jobs = [
            [pool.submit(piece_digest, view, a, b) for a, b in pieces(start, end - start)]
            for start, end in ranges
        ]
        return [
            combine((j.result() for j in parts), end - start)
            for parts, (start, end) in zip(jobs, ranges, strict=True)
        ]


def digest_file(path: str | os.PathLike, threads: int | None = None) -> str:
    """``digest(open(path, 'rb').read())``, without reading the file into memory: mapped and
    hashed in threads (sharded checkpoints store one per file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return digest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return digest_ranges(view, [(0, size)], threads)[0]
            finally:
                view.release()


def manifest_name(names: list[str]) -> str:
    """Where the manifest goes: inside the folder every record of the archive is in."""
    prefix = names[0].split("/", 1)[0] if names and "/" in names[0] else "archive"
    return f"{prefix}/{MANIFEST}"


def is_manifest(name: str) -> bool:
    return name.rsplit("/", 1)[-1] == MANIFEST


def parse(text: bytes) -> dict[str, tuple[int, str]] | None:
    """``{record name: (data size, digest)}`` from a manifest's bytes; None for a manifest of
    another algorithm (an earlier one, or one a later version writes: the caller checks the
    zip's CRC-32 instead); ``ValueError`` if malformed."""
    data = json.loads(text.decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object: {str(data)[:60]!r}")
    if data.get("algorithm") != ALGORITHM:
        return None  # an earlier algorithm (OLD_ALGORITHMS) or a later one: CRC-32 it is
    out = {}
    for name, entry in data["records"].items():
        size, value = entry
        if not (isinstance(value, str) and len(value) == 16):
            raise ValueError(f"malformed digest {str(value)[:40]!r} of {name!r}")
        int(value, 16)
        out[str(name)] = (int(size), value)
    return out


def add_manifest(fd: int, records: list[Any], threads: int | None = None) -> None:
    """Append the manifest of ``records`` (``zipcheck.Entry``s of the zip open on ``fd``,
    read-write) to that zip. Called on the temporary file before its atomic rename."""
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            ranges = [(r.header_offset, r.data_offset + r.size) for r in records]
            digests = digest_ranges(view, ranges, threads)
        finally:
            view.release()
    sums = {r.name: [r.size, d] for r, d in zip(records, digests, strict=True)}
    text = json.dumps({"algorithm": ALGORITHM, "records": sums}, sort_keys=True).encode()
    info = zipfile.ZipInfo(manifest_name([r.name for r in records]), (1980, 1, 1, 0, 0, 0))
    info.external_attr = 0  # a plain file for every reader (the DOS bits stay clear)
    with os.fdopen(os.dup(fd), "r+b") as f, zipfile.ZipFile(f, "a") as z:
        z.writestr(info, text, zipfile.ZIP_STORED)
