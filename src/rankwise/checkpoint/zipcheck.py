"""A checkpoint's zip structure, read the way torch's reader reads it, refused where the two
could differ.

``torch.load`` reads a zip with miniz, which trusts the central directory at the end of the file:
the record's size, compression method, flags, the offset of its local header, and the DOS
attributes. It reads only the name and extra-field lengths of the local header, and checks no
CRC. So one flipped bit in a directory entry can make it read other bytes than were written,
and with the DOS directory bit set (external attributes, bit 4) miniz "extracts" the record by
copying nothing: the tensor is uninitialised memory, and no error is raised.

``entries`` parses the file as miniz does (the end records, zip64 included, then every directory
entry) and refuses, with a ``ConfigError`` naming the file and the record, anything where miniz
could read the record differently from what the writer wrote: a directory entry that disagrees
with its local header or data descriptor (name, method, flags, times, CRC, sizes), a record
that is compressed, encrypted or marked as a directory, and any byte of the file that belongs to
no record (records follow one another from offset 0 to the directory, which ends at the end
records, which end the file). The data offset it returns is the one miniz computes, so the
digest or CRC then checked covers exactly the bytes torch will read.

What it does not constrain is what no reader uses: the directory's "version made by", "version
needed to extract" (zip writers themselves put another value there than in the local header
for zip64 records) and internal attributes, the other external attribute bits, the zip64 end record's versions, and the
contents of local extra fields (covered by the digest, ``sums``, in files that have one).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
END = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
LOCATOR = struct.Struct("<IIQI")  # zip64 end locator, 20 bytes
END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory, 56 bytes
LOCAL_SIG, CENTRAL_SIG, END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
END64_SIG, LOCATOR_SIG, DESCRIPTOR_SIG = 0x06064B50, 0x07064B50, 0x08074B50
MAGIC = b"PK\x03\x04"  # torch reads a file as a zip iff it starts with this (else: legacy)
_FLAGS_OK = 0x0008 | 0x0800  # sizes in a data descriptor; UTF-8 names
_DOS_DIRECTORY = 0x10
_MAX16, _MAX32 = 0xFFFF, 0xFFFFFFFF


@dataclass(frozen=True)
class Entry:
    """One record: its local header, where its data starts (as miniz computes it), its size and
    CRC-32 (from the directory), and where the record's bytes end (after any data descriptor)."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int
    end: int

    @property
    def offset(self) -> int:  # the data's offset (the name the CRC helpers use)
        return self.data_offset


def corrupt(file: Path, entry: str | None, why: str) -> ConfigError:
    """The error for a damaged checkpoint: the file, the record (or the zip directory), why."""
    where = f"record {entry!r}" if entry is not None else "its zip directory"
    try:
        size = f" ({os.path.getsize(file)} bytes)"
    except OSError:
        size = ""
    return ConfigError(
        f"checkpoint {os.fspath(file)!r}{size} is corrupt: {where} {why}; loading it would "
        "resume from wrong values",
        fix="load an earlier checkpoint (rw.list_checkpoints(folder) lists them) or copy the file "
        "again from a good source; check the disk or the transfer that damaged it. If a zip tool "
        "rewrote the file, torch.load it and torch.save it again.",
    )


def is_zip(view: memoryview) -> bool:
    return len(view) >= 4 and bytes(view[:4]) == MAGIC


def entries(view: memoryview, file: Path) -> list[Entry]:
    """Every record of the zip mapped in ``view``, checked as the module says; [] if the file is
    not a zip (torch's legacy format: torch does not read it as one either)."""
    if not is_zip(view):
        if len(view) >= END.size and END.unpack_from(view, len(view) - END.size)[0] == END_SIG:
            raise corrupt(file, None, "ends like a zip but its first bytes are not a zip's "
                          f"signature ({bytes(view[:4])!r}): torch would read it as another format")  # fmt: skip
        return []
    cd_start, cd_end, count = _end_records(view, file)
    out, at = [], cd_start
    for _ in range(count):
        entry, at = _central(view, at, cd_end, file)
        out.append(entry)
    if at != cd_end:
        raise corrupt(file, None, f"has {cd_end - at} bytes after its {count} entries")
    _contiguous(out, cd_start, file)
    return out


def _end_records(view: memoryview, file: Path) -> tuple[int, int, int]:
    """(directory start, directory end, entry count) from the end records, as miniz reads them."""
    at = len(view) - END.size
    if at < 0 or END.unpack_from(view, at)[0] != END_SIG:
        raise corrupt(file, None, "has no end record at the end of the file (the file is "
                      "truncated, or bytes were appended)")  # fmt: skip
    _, disk, cd_disk, on_disk, count, cd_size, cd_start, comment = END.unpack_from(view, at)
    if (disk, cd_disk, comment) != (0, 0, 0) or on_disk != count:
        raise corrupt(file, None, f"has a damaged end record (disk {disk}, directory disk "
                      f"{cd_disk}, entries {on_disk}/{count}, comment length {comment})")  # fmt: skip
    loc = at - LOCATOR.size
    # miniz's rule: a zip64 locator right before the end record makes the zip64 values count
    if loc >= END64.size and LOCATOR.unpack_from(view, loc)[0] == LOCATOR_SIG:
        return _end64(view, file, loc, (count, cd_size, cd_start))
    if count == _MAX16 or _MAX32 in (cd_size, cd_start):
        raise corrupt(file, None, "has zip64 markers in its end record but no zip64 record")
    if cd_start + cd_size != at:
        raise corrupt(file, None, f"says the directory spans {cd_start}..{cd_start + cd_size}, "
                      f"but it must end at the end record ({at})")  # fmt: skip
    return cd_start, at, count


def _end64(
    view: memoryview, file: Path, loc: int, small: tuple[int, int, int]
) -> tuple[int, int, int]:
    _, disk, end64, disks = LOCATOR.unpack_from(view, loc)
    if disk != 0 or disks != 1 or end64 != loc - END64.size:
        raise corrupt(file, None, f"has a damaged zip64 locator (disk {disk}, record at {end64}, "
                      f"{disks} disks)")  # fmt: skip
    sig, size, _, _, disk, cd_disk, on_disk, count, cd_size, cd_start = END64.unpack_from(
        view, end64
    )
    if sig != END64_SIG or size != END64.size - 12 or (disk, cd_disk) != (0, 0) or on_disk != count:
        raise corrupt(file, None, "has a damaged zip64 end record")
    for name, value, short, marker in zip(
        ("entry count", "directory size", "directory offset"),
        (count, cd_size, cd_start),
        small,
        (_MAX16, _MAX32, _MAX32),
        strict=True,
    ):
        if short not in (value, marker):  # miniz reads the zip64 values; both must agree
            raise corrupt(file, None, f"has {name} {short} in its end record but {value} in its "
                          "zip64 end record")  # fmt: skip
    if cd_start + cd_size != end64:
        raise corrupt(file, None, f"says the directory spans {cd_start}..{cd_start + cd_size}, "
                      f"but it must end at the zip64 end record ({end64})")  # fmt: skip
    return cd_start, end64, count


def _zip64_values(extra: bytes, wanted: list[str]) -> dict[str, int] | None:
    """The zip64 extra field's 8-byte values, in the order of ``wanted``; None if absent."""
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 0x0001:
            body = extra[at + 4 : at + 4 + size]
            if len(body) < 8 * len(wanted):
                return None
            return {k: struct.unpack_from("<Q", body, 8 * i)[0] for i, k in enumerate(wanted)}
        at += 4 + size
    return None


def _central(view: memoryview, at: int, cd_end: int, file: Path) -> tuple[Entry, int]:
    if at + CENTRAL.size > cd_end or CENTRAL.unpack_from(view, at)[0] != CENTRAL_SIG:
        raise corrupt(file, None, f"has a damaged entry at offset {at}")
    f = CENTRAL.unpack_from(view, at)
    _, _, _, flags, method, time, date, crc, csize, usize, nlen, xlen, clen, disk, _, ext, lofs = f
    raw = bytes(view[at + CENTRAL.size : at + CENTRAL.size + nlen])
    name = raw.decode("utf-8", "replace")
    extra = bytes(view[at + CENTRAL.size + nlen : at + CENTRAL.size + nlen + xlen])
    end = at + CENTRAL.size + nlen + xlen + clen
    if end > cd_end:
        raise corrupt(file, name, "has a directory entry that runs past the directory")
    wanted = [k for k, v in (("usize", usize), ("csize", csize), ("lofs", lofs)) if v == _MAX32]
    if wanted:
        big = _zip64_values(extra, wanted)
        if big is None:
            raise corrupt(file, name, "has zip64 markers but no zip64 extra field")
        usize, csize, lofs = big.get("usize", usize), big.get("csize", csize), big.get("lofs", lofs)
    why = _refused(flags, method, csize, usize, clen, disk, ext, raw)
    if why:
        raise corrupt(file, name, why)
    return _with_local(view, file, name, raw, (flags, method, time, date, crc, usize), lofs), end


def _refused(flags, method, csize, usize, clen, disk, ext, raw) -> str:
    """Why miniz could read this entry otherwise than torch wrote it ('' if nothing)."""
    if ext & _DOS_DIRECTORY or raw.endswith(b"/"):
        return ("is marked as a directory in the zip directory (external attributes "
                f"{ext:#010x}): torch's reader would return uninitialised memory for it")  # fmt: skip
    if method != 0:
        return f"has compression method {method}; torch stores every record uncompressed"
    if flags & ~_FLAGS_OK:
        return f"has flags {flags:#06x} (encrypted or unknown); torch writes only {_FLAGS_OK:#06x}"
    if csize != usize:
        return f"has stored size {csize} but size {usize} in the zip directory"
    if clen or disk:
        return f"has a comment ({clen} bytes) or disk number ({disk}) torch never writes"
    return ""


def _with_local(view, file, name, raw, central, lofs) -> Entry:
    """Compare a directory entry with its local header (and data descriptor)."""
    flags, method, time, date, crc, size = central
    if lofs + LOCAL.size > len(view) or LOCAL.unpack_from(view, lofs)[0] != LOCAL_SIG:
        raise corrupt(file, name, f"points at offset {lofs}, where there is no local header")
    _, _, l_flags, l_method, l_time, l_date, l_crc, l_csize, l_usize, nlen, xlen = (
        LOCAL.unpack_from(view, lofs)
    )
    data = lofs + LOCAL.size + nlen + xlen  # where miniz starts reading
    if bytes(view[lofs + LOCAL.size : lofs + LOCAL.size + nlen]) != raw:
        raise corrupt(file, name, "has another name in its local header")
    if (l_flags, l_method, l_time, l_date) != (flags, method, time, date):
        raise corrupt(file, name, "has a local header that disagrees with its directory entry "
                      "(flags, method or time)")  # fmt: skip
    if data + size > len(view):
        raise corrupt(file, name, f"runs past the end of the file ({data} + {size} bytes)")
    end = data + size
    if flags & 0x0008:  # sizes and CRC follow the data, in a data descriptor
        allowed = ({0, crc}, {0, size, _MAX32})
        wide = _zip64_values(bytes(view[data - xlen : data]), []) is not None
        end = _descriptor(view, file, name, data + size, (crc, size), wide)
    else:
        allowed = ({crc}, {size, _MAX32})
    if l_crc not in allowed[0] or l_csize not in allowed[1] or l_usize not in allowed[1]:
        raise corrupt(file, name, "has a CRC or size in its local header that disagrees with "
                      "the zip directory")  # fmt: skip
    return Entry(name, lofs, data, size, crc, end)


def _descriptor(view, file, name, at, crc_size, wide) -> int:
    """Check the data descriptor after the data (8-byte sizes in a zip64 record); where the
    record ends."""
    crc, size = crc_size
    fmt = "<IIQQ" if wide else "<IIII"
    n = struct.calcsize(fmt)
    if at + n > len(view):
        raise corrupt(file, name, "is cut short (its data descriptor is missing)")
    sig, d_crc, d_csize, d_usize = struct.unpack_from(fmt, view, at)
    if (sig, d_crc, d_csize, d_usize) != (DESCRIPTOR_SIG, crc, size, size):
        raise corrupt(file, name, "has a data descriptor that disagrees with the zip directory")
    return at + n


def _contiguous(found: list[Entry], cd_start: int, file: Path) -> None:
    """Records follow one another from offset 0 to the directory, each name once."""
    at, names = 0, set()
    for e in found:
        if e.name in names:
            raise corrupt(file, e.name, "appears twice in the zip directory")
        names.add(e.name)
        if e.header_offset != at:
            raise corrupt(file, e.name, f"starts at offset {e.header_offset}, but the record "
                          f"before it ends at {at}")  # fmt: skip
        at = e.end
    if at != cd_start:
        raise corrupt(file, None, f"starts at offset {cd_start}, but the last record ends at {at}")
