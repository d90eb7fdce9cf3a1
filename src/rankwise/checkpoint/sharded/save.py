"""Sharded saves in torch DCP's format: every rank writes what it holds, in parallel.

1. **Plan** (``plan``; one JSON all-gather): each rank lists the pieces it holds (``pieces``,
   ``optim_pieces``: rectangles of the full tensors, keyed as ``dcp_meta`` says) and its
   non-tensor values; rank 0 adds the target and a temporary folder it has just made,
   ``.<target>.<random>.tmp`` beside it. Every rank then makes the same choice of who writes
   each piece (``assign``): a piece only one rank holds (a ZeRO shard's) is its own; one held
   by several replicas goes to the least loaded of them, so replicated state is written once
   and the writing is spread.
2. **Write** (``write``): each rank writes its pieces into ``__<rank>_0.distcp`` in the
   temporary folder, each item ``torch.save``'d as DCP's ``FileSystemWriter`` does (without
   the zip records' CRC-32, which ``torch.load`` never checks), hashing the bytes as they go
   (``digests``), around the page cache where the filesystem allows (``checkpoint/direct``).
3. **Publish** (``finish``; one JSON all-gather, one JSON broadcast): rank 0 learns that every
   rank succeeded, writes DCP's ``.metadata`` and ``rankwise.json`` (checksums, step, world
   size, mesh), fsyncs, and renames the folder into place (``files.publish_dir``); then
   ``latest`` and rotation, as for one file. A failure anywhere removes the temporary folder
   and raises on every rank; a rank killed at any moment leaves only the hidden temporary
   folder, which the next save removes, and ``latest`` where it was.

torch's ``dcp.save`` would exchange the plans as pickles (``gather_object``); rankwise's
messages between ranks are JSON (``wire``), so the plan travels as JSON here. Nothing a rank
sends is unpickled, and the files are in DCP's format (DCP reads them).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ... import runtime
from ...comm import collectives as comm
from ...comm import wire
from ...errors import ConfigError, DistributedError
from ...version import __version__
from .. import files, rng
from ..direct import DirectFile
from ..state_dict import model_class_name
from . import dcp_meta, digests
from .assign import assign, merged_names
from .optim_pieces import optimizer_pieces
from .pieces import Blob, Piece, model_pieces
from .read import FORMAT, MANIFEST_DIGEST, MANIFEST_VERSION, item_id, manifest_digest

VERSION = MANIFEST_VERSION


@dataclass
class Plan:
    """One save, as this rank sees it after the plan's all-gather."""

    target: Path
    tmp: Path
    is_dir: bool
    keep_last: int
    rank: int
    offers: list[list[dict[str, Any]]]
    """Every rank's offers (what it holds), in rank order."""
    writes: list[list[int]]
    """Per rank, the indices of its offers it writes."""
    data: dict[int, Any]
    """This rank's offer index -> its data (a tensor view, a staged copy, or bytes)."""
    manifest: dict[str, Any] = field(default_factory=dict)


def collect(
    model: nn.Module, optimizer: Any, scheduler: Any, loader: Any, extra: dict[str, Any]
) -> tuple[list[Piece], list[Blob]]:
    """What this rank holds: model and optimizer pieces, its RNG, and (rank 0) the rest."""
    from ..single import _stateful

    pieces, blobs = model_pieces(model, loading=False)
    if optimizer is not None:
        more, values = optimizer_pieces(optimizer, model)
        pieces, blobs = pieces + more, blobs + values
    rank = comm.rank()
    blobs.append(Blob(*dcp_meta.own_key("rng", rank), value=rng.capture(), shared=False))
    if rank == 0:
        own = {"loader": _stateful(loader), "extra": dict(extra)}
        if scheduler is not None:
            own["scheduler"] = scheduler.state_dict()
        blobs += [Blob(*dcp_meta.own_key(k), value=v, shared=False) for k, v in own.items()
                  if v is not None]  # fmt: skip
    return pieces, blobs


def _offer(item: Piece | Blob, data: Any) -> dict[str, Any]:
    if isinstance(item, Blob):
        out = {"key": item.key, "path": item.path, "kind": "b", "nbytes": len(data),
               "shared": item.shared, "same": _digest64(repr(item.value).encode())}  # fmt: skip
        if item.path[-1:] == ["params"] and isinstance(item.value, list):
            out["names"] = [str(n) for n in item.value]  # a group's names: merged over ranks
        return out
    t = item.tensor
    return {
        "key": item.key, "path": item.path, "kind": "t", "dtype": dcp_meta.dtype_name(t.dtype),
        "shape": list(item.shape), "offsets": list(item.box.offsets),
        "sizes": list(item.box.sizes), "nbytes": item.box.numel * t.element_size(),
        "shared": item.shared,
    }  # fmt: skip


def _check_args(step: Any, epoch: Any, keep_last: int) -> None:
    files.check_step(step)
    if keep_last < 1:
        raise ConfigError(f"keep_last={keep_last} must be at least 1",
                          fix="keep at least the checkpoint just written, e.g. keep_last=3.")  # fmt: skip
    if not isinstance(epoch, (int, float, str, type(None))) or isinstance(epoch, bool):
        raise ConfigError(f"epoch={epoch!r} ({type(epoch).__name__}) must be an int",
                          fix="pass the epoch number, e.g. epoch=int(epoch).")  # fmt: skip


def plan(
    path: str | os.PathLike, *, model: nn.Module, optimizer: Any = None, scheduler: Any = None,
    loader: Any = None, step: int | None = None, epoch: Any = None, keep_last: int = 3,
    extra: dict[str, Any] | None = None, group: Any = None,
) -> Plan:  # fmt: skip
    """Collect what this rank holds and agree who writes what. Sync point: the ranks of
    ``group`` (all ranks; one JSON all-gather)."""
    _check_args(step, epoch, keep_last)
    rank, error, offers, data = comm.rank(), "", [], {}
    where: dict[str, Any] = {}
    try:
        pieces, blobs = collect(model, optimizer, scheduler, loader, extra or {})
        for i, item in enumerate([*pieces, *blobs]):
            data[i] = item.tensor if isinstance(item, Piece) else wire.encode_tensors(item.value)
            offers.append(_offer(item, data[i]))
        if rank == 0:
            where = _make_tmp(Path(path), step)
    except Exception as exc:  # told to every rank below, so none waits for this one
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ConfigError) and comm.world_size() == 1:
            raise
    message = {"error": error, "offers": offers, **where}
    every = [message] if comm.world_size() == 1 else wire.all_gather_json(
        message, label="sharded checkpoint plan", group=group)  # fmt: skip
    _raise_failed(every, "planning the sharded save", rank, Path(every[0].get("tmp") or "."))
    head = every[0]
    target, tmp = Path(head["target"]), Path(head["tmp"])
    offers = [m["offers"] for m in every]
    writes = assign(offers)
    for i in writes[rank]:  # a pipeline stage's group lists its names only: write them all
        if "names" in offers[rank][i]:
            data[i] = wire.encode_tensors(merged_names(offers, offers[rank][i]["key"]))
    out = Plan(target, tmp, head["is_dir"], keep_last, rank, offers, writes,
               {i: data[i] for i in writes[rank]})  # fmt: skip
    if rank == 0:
        out.manifest = _manifest(model, step, epoch)
    return out


def _make_tmp(path: Path, step: int | None) -> dict[str, Any]:
    """Rank 0: the target, and a fresh temporary folder beside it (leftovers removed)."""
    is_dir = files.is_dir_target(path)
    target = files.dir_target(path, step, suffix="") if is_dir else path
    target.parent.mkdir(parents=True, exist_ok=True)
    files.remove_leftovers(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~files._umask())
    return {"target": str(target), "tmp": str(tmp), "is_dir": is_dir}


def _raise_failed(every: list[dict[str, Any]], what: str, rank: int, tmp: Path) -> None:
    failed = [(r, m["error"]) for r, m in enumerate(every) if m.get("error")]
    if not failed:
        return
    if rank == 0 and tmp.name.endswith(".tmp"):
        files.remove(tmp)
    r, error = failed[0]
    raise DistributedError(
        f"{what} failed on rank {r}: {error}",
        fix="fix the cause named above; the previous checkpoint is untouched.",
        rank=rank,
    )


def _manifest(model: nn.Module, step: Any, epoch: Any) -> dict[str, Any]:
    rt = runtime.get_runtime() if runtime.is_initialized() else None
    mesh = getattr(rt, "mesh", None)
    return {
        "format": FORMAT, "version": VERSION, "step": step, "epoch": epoch,
        "world_size": comm.world_size(),
        "mesh": None if mesh is None else {k: int(v) for k, v in mesh.sizes.items()},
        "strategy": getattr(rt, "strategy", None), "engine": type(model).__name__,
        "model_class": model_class_name(model), "rankwise_version": __version__,
        "torch_version": str(torch.__version__), "saved_at": time.time(),
    }  # fmt: skip


# -- writing and publishing ----------------------------------------------------------------


def compact_cpu(t: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """A CPU tensor holding exactly ``t``'s elements (``torch.save`` writes a view's whole
    storage): a copy unless ``t`` already is one; pinned when ``pin`` (a staged CUDA copy)."""
    t = t.detach()
    exact = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    if t.device.type == "cpu" and exact and not pin:
        return t
    if t.device.type == "cpu" and t.is_contiguous() and not pin:
        alias = _alias(t)  # a ZeRO shard's piece: a contiguous run inside the flat shard
        if alias is not None:
            return alias
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and torch.cuda.is_available())
    out.copy_(t, non_blocking=pin)
    return out


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _alias(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor over exactly the bytes of the contiguous CPU view ``t``, without a copy (None
    where it cannot be made): its storage holds those bytes alone, so ``torch.save`` writes
    what it writes for a compact copy of ``t``, byte for byte, without copying a ZeRO shard's
    pieces first (0.55 s of a 2.8 s save of 768 MB per rank). Through numpy, which wraps the
    memory as it is; dtypes numpy lacks (bfloat16) pass as an integer of their size."""
    same = _SAME_SIZE.get(t.element_size())
    if same is None or t.numel() == 0 or t.is_conj() or t.is_neg():  # empty: copying is free
        return None
    try:
        return torch.from_numpy(t.view(same).numpy()).view(t.dtype)
    except (RuntimeError, TypeError):
        return None


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each zip record: ``torch.load`` never checks it, and
    every item here has its xxh3 checked at each load instead. Computing it was half the
    writing thread's CPU (0.19 of 0.34 s for 0.8 GB), taken from the training's steps by a
    background save. (torch's switch is process-wide: set for one item's save at a time.)"""
    get = getattr(torch.serialization, "get_crc32_options", None)
    before = get() if get is not None else None
    if before:
        torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        if before:
            torch.serialization.set_crc32_options(True)


def write(plan: Plan) -> dict[str, Any]:
    """Write this rank's pieces into its file in the temporary folder."""
    mine = plan.writes[plan.rank]
    if not mine:
        return {"error": "", "file": None, "items": []}
    name = f"__{plan.rank}_0.distcp"
    offers = plan.offers[plan.rank]
    items = []
    raw = DirectFile(plan.tmp / name)  # around the page cache: see checkpoint/direct.py
    try:
        out = digests.HashingWriter(raw)
        for i in mine:
            start = out.begin_item()
            if offers[i]["kind"] == "t":
                with _without_zip_crc():
                    torch.save(compact_cpu(plan.data[i]), out)
            else:
                out.write(plan.data[i])
            items.append([start, out.tell() - start, out.end_item()])
    except BaseException:
        raw.abort()
        raise
    raw.close()  # the last block, then fsync
    return {"error": "", "file": name, "bytes": out.tell(),
            "digest": out.file_hash.hexdigest(), "items": items}  # fmt: skip


def finish(plan: Plan, group: Any = None) -> Path:
    """Write, learn that every rank did, publish (rank 0). Sync point: the ranks of ``group``
    (one JSON all-gather, one JSON broadcast)."""
    try:
        result = write(plan)
    except Exception as exc:  # in the disk's words, to every rank
        result = {"error": files.describe_write_error(exc, plan.tmp)}
    single = comm.world_size() == 1
    results = [result] if single else wire.all_gather_json(
        result, label="sharded checkpoint writes", group=group)  # fmt: skip
    status = ["ok", ""]
    if plan.rank == 0:
        status = _publish(plan, results)
    if not single:
        status = wire.broadcast_json(status, label="sharded checkpoint status", group=group)
    if not (isinstance(status, list) and len(status) == 2 and status[0] == "ok"):
        raise DistributedError(
            f"saving the sharded checkpoint at {os.fspath(plan.target)!r} failed: "
            f"{status[1] if isinstance(status, list) and len(status) == 2 else status!r}",
            fix="check that the folder is writable and has space on every rank's filesystem; "
            "the previous checkpoint is untouched.", rank=plan.rank,
        )  # fmt: skip
    return Path(status[1])


def _publish(plan: Plan, results: list[dict[str, Any]]) -> list[str]:
    failed = [(r, res["error"]) for r, res in enumerate(results) if res.get("error")]
    try:
        if failed:
            raise OSError(f"rank {failed[0][0]}: {failed[0][1]}")
        items, digest_of, listed = [], {}, {}
        for r, res in enumerate(results):
            if res["file"]:
                listed[res["file"]] = {"bytes": res["bytes"], digests.FILE_DIGEST: res["digest"]}
            for i, (offset, length, digest) in zip(plan.writes[r], res["items"], strict=True):
                o = plan.offers[r][i]
                items.append({**o, "file": res["file"], "offset": offset, "length": length})
                digest_of[item_id(o["key"], o.get("offsets") if o["kind"] == "t" else None)] = (
                    digest
                )
        data = dcp_meta.dumps(dcp_meta.build(items, os.fspath(plan.target)))
        manifest = {**plan.manifest, "metadata": {"bytes": len(data),
                    digests.FILE_DIGEST: _digest128(data)}, "files": listed, "items": digest_of}  # fmt: skip
        manifest[MANIFEST_DIGEST] = manifest_digest(manifest)  # the step, the checksums: all
        _write_synced(plan.tmp / dcp_meta.MANIFEST, json.dumps(manifest, indent=1).encode())
        _write_synced(plan.tmp / dcp_meta.METADATA, data)
        files.publish_dir(plan.tmp, plan.target)
        if plan.is_dir:
            files.write_text_atomic(plan.target.name + "\n", plan.target.parent / files.LATEST)
            files.prune(plan.target.parent, plan.keep_last, plan.target)
        return ["ok", str(plan.target)]
    except Exception as exc:  # every rank hears it, in the disk's words
        files.remove(plan.tmp)
        return ["error", files.describe_write_error(exc, plan.target) if not failed else str(exc)]


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _digest128(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128(data).hexdigest()


def _digest64(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_64(data).hexdigest()


def save_sharded(path: str | os.PathLike, *, model: nn.Module, **kwargs: Any) -> Path:
    """Save now (``rw.save_checkpoint(..., sharded=True)``). Sync point: all ranks."""
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in _NAMED}
    return finish(plan(path, model=model, extra=extra, **kwargs))


_NAMED = ("optimizer", "scheduler", "loader", "step", "epoch", "keep_last", "group")
