"""Reading a DCP checkpoint folder: each rank reads the saved chunks that overlap what it holds.

``Reader`` opens a folder written by rankwise or by ``torch.distributed.checkpoint`` (FSDP2's
``dcp.save``) and refuses it, before anything is allocated or read, unless it is complete and
consistent (docs/checkpoints.md, "what is checked"): ``rankwise.json`` carries a checksum of
itself and of ``.metadata`` (a folder without it is read as a plain DCP checkpoint, saying so,
unless rankwise's own keys show it lost its manifest); ``.metadata`` is read under its size cap
without running code, and every tensor's chunks tile it exactly (``dcp_meta.read_metadata``);
every file it names is a regular file inside the folder holding the bytes declared
(``untrusted``). Each item's bytes are then checked against ``rankwise.json``'s checksum before
torch parses them, and every item is read with ``torch.load(weights_only=True)``. ``fill`` copies the overlap of each saved chunk with each
wanted ``Piece`` straight into the piece's view: one saved chunk in memory at a time, whatever
the world size or mesh either side.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from ...errors import ConfigError
from .. import untrusted
from . import digests
from .boxes import Box, Split, numel, overlap
from .dcp_meta import MANIFEST, MAX_METADATA_BYTES, METADATA, OPTIM, OWN, read_metadata
from .pieces import Piece

FORMAT = "rankwise-dcp"
MANIFEST_VERSION = 2
"""``rankwise.json``'s format version: 2 carries its own checksum (``digest``)."""
MANIFEST_DIGEST = "digest"
MAX_MANIFEST_BYTES = 256 << 20
"""A manifest lists a checksum per item: tens of MB for the largest models. More is not one."""
_EARLIER = "the checkpoint is damaged or incomplete; load an earlier one."


def item_id(key: str, offsets: Any) -> str:
    """How ``rankwise.json`` names an item: its key, and a tensor chunk's offsets."""
    return key if offsets is None else f"{key}@{','.join(map(str, offsets))}"


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The checksum ``rankwise.json`` carries of itself: ``xxh3_128`` of everything else in it,
    as canonical JSON (sorted keys, no spaces), so that a changed step, epoch or item checksum
    is caught and bytes JSON ignores (spaces between values) are not counted."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST}
    return _digest128(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """``rankwise.json``, its own checksum checked first (None for a folder without one)."""
    path = folder / MANIFEST
    if not os.path.lexists(path):
        return None
    untrusted.inside(path, folder, "the manifest")
    raw = untrusted.read_capped(path, MAX_MANIFEST_BYTES, "rankwise manifest")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"cannot read {os.fspath(path)!r}: {type(exc).__name__}: {exc}",
                          fix="the checkpoint is damaged; load an earlier one.") from None  # fmt: skip
    want = manifest.get(MANIFEST_DIGEST) if isinstance(manifest, dict) else None
    if not isinstance(want, str):
        raise ConfigError(
            f"{os.fspath(path)!r} carries no checksum of itself ({MANIFEST_DIGEST!r}): it is "
            "damaged, or was written by a rankwise older than the format version "
            f"{MANIFEST_VERSION}",
            fix="load an earlier checkpoint; one written by an older rankwise loads with that "
            "version (`rankwise checkpoint consolidate` there makes one file of it).",
        )
    got = manifest_digest(manifest)
    if got != want:
        raise digests.damaged(path, "the manifest", got, want)
    ok = manifest.get("format") == FORMAT
    items = manifest.get("items") if ok else None
    ok = ok and isinstance(items, dict) and all(isinstance(v, str) for v in items.values())
    ok = ok and isinstance(manifest.get("files", {}), dict)
    ok = ok and isinstance(manifest.get("metadata", {}), dict)
    if not ok:
        raise ConfigError(f"{os.fspath(path)!r} is not a rankwise sharded checkpoint manifest",
                          fix="load an earlier checkpoint, or remove the file.")  # fmt: skip
    return manifest


def _plain_dcp(folder: Path, md: dcp_md.Metadata) -> None:
    """A folder without ``rankwise.json``: torch's ``dcp.save`` wrote it (read, saying what is
    not checked), unless rankwise's own keys say rankwise did (then the manifest is lost)."""
    own = sorted(k for k in md.state_dict_metadata if k.startswith(OWN + "."))
    if own:
        raise ConfigError(
            f"{os.fspath(folder)!r} holds rankwise's own keys ({own[:2]}) but no {MANIFEST}: "
            "the checksums of this rankwise checkpoint are missing, so it cannot be checked",
            fix=f"copy the whole folder again ({MANIFEST} included) or load an earlier "
            "checkpoint.",
        )
    warnings.warn(
        f"{os.fspath(folder)!r} has no {MANIFEST}: read as a plain DCP checkpoint (torch's "
        "dcp.save writes no checksums). Its chunks are checked to tile every tensor and its "
        "files to hold every item .metadata declares, but a changed byte inside an item "
        "cannot be detected.",
        stacklevel=5,  # the caller of rw.load_checkpoint
    )


def _check_files(folder: Path, md: dcp_md.Metadata) -> None:
    """Every file ``.metadata`` names is a regular file inside the folder holding the bytes it
    declares, each tensor chunk's item at least the chunk's data: checked before anything is
    allocated or read, so a declared shape never asks for more memory than the files hold."""
    where = os.fspath(folder / METADATA)
    sizes = {}
    for name in sorted({info.relative_path for info in md.storage_data.values()}):
        path = folder / name
        untrusted.inside(path, folder, f"a file its {METADATA} names")
        sizes[name] = untrusted.regular(path, f"a file its {METADATA} names").st_size
    for index, info in md.storage_data.items():
        if info.offset + info.length > sizes[info.relative_path]:
            raise ConfigError(
                f"{where!r} says {index.fqn!r} lies at bytes {info.offset}.."
                f"{info.offset + info.length} of {info.relative_path!r}, which holds "
                f"{sizes[info.relative_path]} bytes", fix=_EARLIER,
            )  # fmt: skip
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, dcp_md.TensorStorageMetadata):
            continue
        for chunk in entry.chunks:
            info = md.storage_data[dcp_md.MetadataIndex(key, chunk.offsets)]
            need = numel(chunk.sizes) * entry.properties.dtype.itemsize
            if info.length < need:
                raise ConfigError(
                    f"{where!r} declares the chunk of {key!r} at {list(chunk.offsets)} as "
                    f"{list(chunk.sizes)} {entry.properties.dtype} ({need} bytes), but its item "
                    f"in {info.relative_path!r} is {info.length} bytes", fix=_EARLIER,
                )  # fmt: skip


class Reader:
    """One checkpoint folder, opened for reading (``with Reader(folder) as r:``): the
    manifest's and the metadata's checksums, the chunks' tiling and the files' sizes are
    checked here, before anything is read."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fds: dict[str, int] = {}
        self.manifest = read_manifest(folder)
        untrusted.inside(folder / METADATA, folder, "DCP metadata")
        data = untrusted.read_capped(folder / METADATA, MAX_METADATA_BYTES, "DCP metadata")
        if self.manifest is not None:
            want = self.manifest.get("metadata", {}).get(digests.FILE_DIGEST)
            got = _digest128(data)
            if want != got:
                raise digests.damaged(folder / METADATA, "the file", got, str(want))
        self.md = read_metadata(folder, data)
        if self.manifest is None:
            _plain_dcp(folder, self.md)
        _check_files(folder, self.md)
        self.entries: dict[str, Any] = self.md.state_dict_metadata
        self.items: dict[str, str] | None = (
            None if self.manifest is None else self.manifest["items"]
        )

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # -- what is there --------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.entries)

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.entries.get(key), dcp_md.TensorStorageMetadata)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key].properties.dtype

    def is_param_shaped(self, key: str, local: torch.Size, split: Split | None) -> bool:
        """True when ``key`` holds a tensor of the full shape of a parameter whose slice here
        is ``local`` (``split``: its tensor-parallel placement)."""
        full = tuple(local) if split is None else split.full_shape(local)
        return self.is_tensor(key) and self.shape(key) == full and len(full) > 0

    def state_index(self, prefix: str) -> dict[str, dict[str, str]]:
        """Parameter name -> {state name -> key} under ``<prefix>state.``."""
        head = prefix + "state."
        out: dict[str, dict[str, str]] = {}
        for key in self.entries:
            if key.startswith(head) and "." in key[len(head) :]:
                fqn, name = key[len(head) :].rsplit(".", 1)
                out.setdefault(fqn, {})[name] = key
        return out

    def groups(self, prefix: str) -> list[dict[str, Any]]:
        """The saved optimizer groups' settings (``params``: the parameter names)."""
        head = prefix + "param_groups."
        found: dict[int, dict[str, Any]] = {}
        for key in self.entries:
            index, _, setting = key[len(head) :].partition(".")
            if key.startswith(head) and index.isdigit() and setting:
                found.setdefault(int(index), {})[setting] = self.blob(key)
        return [found[i] for i in sorted(found)]

    def optimizer_prefix(self, fqns: list[str]) -> str | None:
        """Where the optimizer state lives: ``optim.`` (ours, ``dcp.save({"optim": ...})``),
        ``app.optim.`` (torch's tutorial) or any other prefix ending in ``state.<name>.``."""
        tails = [f"state.{fqn}." for fqn in fqns] + ["param_groups.0.params"]
        for tail in tails:  # an optimizer without state (SGD without momentum) has groups
            for key in self.entries:
                at = key.find(tail)
                if at >= 0 and (at == 0 or key[at - 1] == "."):
                    return key[:at]
        return None

    def model_prefix(self, fqns: list[str]) -> str:
        """The prefix in front of the model's keys: ``model.`` (ours), ``app.model.``, ...:
        the one under which most of ``fqns`` are found."""
        counts: dict[str, int] = {}
        for fqn in fqns[:64]:
            for key in self.entries:
                if key.endswith(fqn) and (len(key) == len(fqn) or key[-len(fqn) - 1] == "."):
                    prefix = key[: len(key) - len(fqn)]
                    if (
                        not prefix.startswith((OPTIM + ".", "rankwise."))
                        and ".state." not in prefix
                    ):
                        counts[prefix] = counts.get(prefix, 0) + 1
        return max(counts, key=lambda p: (counts[p], p == "model."), default="model.")

    # -- reading ----------------------------------------------------------------------------

    def blob(self, key: str) -> Any:
        """A saved non-tensor value (or a whole tensor), read with ``weights_only=True``."""
        index = dcp_md.MetadataIndex(key)
        if index not in self.md.storage_data:
            raise ConfigError(f"the checkpoint in {os.fspath(self.folder)!r} lists {key!r} "
                              "without its data", fix="load an earlier checkpoint.")  # fmt: skip
        return self._load(index, key, None)

    def fill(self, pieces: list[Piece]) -> None:
        """Copy every saved chunk's overlap with each piece into the piece's view."""
        work: dict[tuple[str, tuple[int, ...]], list[tuple[Piece, Box, Box]]] = {}
        for piece in pieces:
            entry = self.entries.get(piece.key)
            if not isinstance(entry, dcp_md.TensorStorageMetadata):
                raise ConfigError(f"the checkpoint has no tensor {piece.key!r}",
                                  fix="load a checkpoint of the same model.")  # fmt: skip
            covered = 0
            for chunk in entry.chunks:
                saved = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                both = overlap(piece.box, saved)
                if both is not None:
                    work.setdefault((piece.key, saved.offsets), []).append((piece, both, saved))
                    covered += both.numel
            if covered != piece.box.numel:
                raise ConfigError(
                    f"the checkpoint in {os.fspath(self.folder)!r} holds only part of "
                    f"{piece.key!r} ({covered} of the {piece.box.numel} elements wanted here)",
                    fix="the save was incomplete; load an earlier checkpoint.",
                )
        order = sorted(work.items(), key=self._position)
        indices = [dcp_md.MetadataIndex(key, offsets) for (key, offsets), _ in order]
        if indices:
            self._read_ahead(indices[0])
        for k, ((key, _), wanted) in enumerate(order):
            if k + 1 < len(indices):  # the next item's reads start while this one is copied
                self._read_ahead(indices[k + 1])
            chunk = self._load(indices[k], key, wanted[0][2])
            for piece, both, saved in wanted:
                src = chunk[_slices(both, saved)]
                piece.tensor[_slices(both, piece.box)].copy_(src)
            del chunk

    def _position(self, item: tuple[tuple[str, tuple[int, ...]], Any]) -> tuple[str, int]:
        info = self.md.storage_data[dcp_md.MetadataIndex(*item[0])]
        return info.relative_path, info.offset

    def _read_ahead(self, index: dcp_md.MetadataIndex) -> None:
        """Start reading the item at ``index`` from the disk (``_will_need``)."""
        info = self.md.storage_data.get(index)
        if info is not None:
            _will_need(self._fd(info.relative_path), info.offset, info.length)

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            path = self.folder / name
            untrusted.inside(path, self.folder, "a file of the checkpoint")
            self._fds[name] = untrusted.open_regular(path, "a file of the checkpoint")
        return self._fds[name]

    def _load(self, index: dcp_md.MetadataIndex, key: str, saved: Box | None) -> Any:
        info = self.md.storage_data.get(index)
        if info is None:
            raise ConfigError(f"the checkpoint lists no data for {key!r} at {index.offset}",
                              fix="load an earlier checkpoint.")  # fmt: skip
        path = self.folder / info.relative_path
        fd = self._fd(info.relative_path)
        if self.items is not None:
            name = item_id(key, None if saved is None else saved.offsets)
            got = digests.range_digest(fd, info.offset, info.length)
            if got != self.items.get(name):
                raise digests.damaged(path, f"item {name!r}", got, str(self.items.get(name)))
        stream = io.BufferedReader(digests.FileSlice(fd, info.offset, info.length))
        try:
            value = torch.load(stream, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch's reasons vary by version: name the file and the item
            raise ConfigError(
                f"cannot read {key!r} from {os.fspath(path)!r} (bytes {info.offset}.."
                f"{info.offset + info.length}, as {METADATA} says): {type(exc).__name__}: "
                f"{str(exc)[:200]}",
                fix="the file is damaged or holds an object outside torch's weights_only "
                "allow-list; load an earlier checkpoint.",
            ) from None
        if saved is not None and not (isinstance(value, torch.Tensor)
                                      and tuple(value.shape) == saved.sizes):  # fmt: skip
            raise ConfigError(f"{os.fspath(path)!r} holds for {key!r} something other than the "
                              f"{saved.sizes} chunk its {METADATA} names",
                              fix="load an earlier checkpoint.")  # fmt: skip
        return value


def _will_need(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to read the whole item ahead: a file cold on the disk then arrives in
    large reads, while the first bytes are hashed (without it, readahead's small windows)."""
    with contextlib.suppress(AttributeError, OSError):  # no posix_fadvise (macOS)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


def _slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """``inner``'s place inside ``outer``, as an index into ``outer``'s data."""
    return tuple(slice(i - o, i - o + s) for i, o, s in
                 zip(inner.offsets, outer.offsets, inner.sizes, strict=True))  # fmt: skip


def _digest128(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128(data).hexdigest()
