"""``rw.save_pretrained(model, folder)``: the consolidated model as Hugging Face safetensors,
streamed.

Every rank walks the model's tensors in the same order; a ZeRO-3 unit is gathered when its
first tensor is due and freed after its last, a tensor-parallel piece is all-gathered into the
whole tensor, and rank 0 writes each tensor's bytes as it arrives (``writer.py``), so no rank
ever holds more than the model it already had plus one unit (and one whole tensor). The files
are those ``save_pretrained`` writes (``model.safetensors`` or shards with an index; with a
Hugging Face model, its ``config.json`` and ``generation_config.json``) and
``from_pretrained`` reads them. The folder appears atomically: built under a temporary name,
renamed into place; a failure leaves the previous export as it was.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...comm import collectives as comm
from ...comm import wire
from ...errors import ConfigError, DistributedError
from ...parallel.tensor.shards import unshard
from ..state_dict import registered_inner
from .targets import Target, model_targets, wrappers, zero_engine
from .writer import (
    NAMES,
    Item,
    file_names,
    header,
    new_folder,
    parse_size,
    shard_files,
    swap_into_place,
    write_index,
    write_tensor,
)


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    config: bool = True,
) -> Path:
    """Write ``model`` (prepared or bare) whole into ``directory`` as safetensors.

    ``max_shard_size``: bytes or ``"5GB"``-style; larger exports are cut into shard files with
    ``model.safetensors.index.json``. ``dtype``: cast floating-point tensors (e.g.
    ``torch.bfloat16``); default: as they are. ``config``: also write a Hugging Face model's
    ``config.json`` (and ``generation_config.json``). Returns the folder.

    Sync point: all ranks (ZeRO-3 units and tensor-parallel pieces are gathered); rank 0
    writes, and every rank raises if the write failed.
    """
    _refuse_pipeline(model)
    groups = _groups(model)
    items = {id(t): _item(t, dtype) for _, ts in groups for t in ts}
    files = shard_files([items[id(t)] for _, ts in groups for t in ts], parse_size(max_shard_size))
    writer = _Writer(Path(directory), files) if comm.rank() == 0 else None
    for target, tensor in _stream(groups):
        if writer is not None:
            writer.put(items[id(target)], tensor)
    error = "" if writer is None else writer.finish(registered_inner(model), config, dtype)
    if comm.world_size() > 1:
        error = wire.broadcast_json(error, label="save_pretrained status")
    if error:
        raise DistributedError(
            f"save_pretrained to {os.fspath(directory)!r} failed on rank 0: {str(error)[:400]}",
            fix="see rank 0's error; the folder is as it was before the call.",
            rank=comm.rank(),
        )
    return Path(directory)


def _refuse_pipeline(model: nn.Module) -> None:
    """A pipeline's ranks hold different layers: rank 0 alone would write its own stage."""
    pipe = next((m for m in wrappers(model) if len(getattr(m, "ranks", ())) > 1
                 and hasattr(m, "stage_index")), None)  # fmt: skip
    if pipe is not None:
        raise ConfigError(
            f"save_pretrained got a pipeline over ranks {list(pipe.ranks)}: each rank holds "
            "other layers, and the export is written from rank 0's model",
            fix="export from a model that holds every layer on every rank (ZeRO, DDP or a "
            "mesh shard it instead), or save each stage with rw.save_checkpoint.",
        )


def _item(target: Target, dtype: torch.dtype | None) -> Item:
    have = target.tensor.dtype
    want = dtype if dtype is not None and have.is_floating_point else have
    if want not in NAMES or target.tensor.is_meta:
        why = "is still on the meta device" if target.tensor.is_meta else f"is {want}"
        raise ConfigError(
            f"cannot export {target.names[0]}: it {why}",
            fix="prepare the model first (rt.prepare materializes it); safetensors holds "
            f"{sorted(str(d) for d in NAMES)}.",
        )
    return Item(target.names[0], target.full_shape, want)


def _groups(model: nn.Module) -> list[tuple[Any, list[Target]]]:
    """The tensors in the order they are gathered and written: each ZeRO-3 unit's together
    (``(unit, targets)``), then the rest (``(None, targets)``)."""
    targets = model_targets(model)
    engine = zero_engine(model)
    if engine is None or engine.stage < 3:
        return [(None, targets)]
    of_unit: dict[int, list[Target]] = {id(u): [] for u in engine.units}
    rest = []
    for t in targets:
        (of_unit[id(t.unit)] if t.unit is not None else rest).append(t)
    groups = [(u, sorted(of_unit[id(u)], key=lambda t: t.index)) for u in engine.units]
    return [g for g in groups if g[1]] + [(None, rest)]


def _stream(groups: list[tuple[Any, list[Target]]]) -> Iterator[tuple[Target, torch.Tensor]]:
    """Each tensor whole, in order, on every rank (one ZeRO-3 unit gathered at a time).
    Sync point: all ranks."""
    for unit, targets in groups:
        gather = unit is not None and not unit.gathered
        if gather:
            unit.gather()
            unit.wait_gathered()
        try:
            for t in targets:
                yield t, _whole(t)
        finally:
            if gather:
                unit.free()


def _whole(target: Target) -> torch.Tensor:
    value = target.tensor.detach()
    split = target.split
    if split is None or split.size == 1:
        return value
    pieces = comm.all_gather_tensors(
        value.contiguous(), group=target.group, label=f"save_pretrained {target.names[0]}"
    )
    return unshard(pieces, split.dim, split.chunks)


class _Writer:
    """Rank 0's side: the files, written tensor by tensor. A failure is kept (the other ranks
    still need this rank in every gather) and reported by ``finish``."""

    def __init__(self, target: Path, files: list[list[Item]]) -> None:
        self.target, self.files, self.names = target, files, file_names(len(files))
        self.error: BaseException | None = None
        self.folder: Path | None = None
        self.handle: Any = None
        self.at = (-1, 0)  # (file, items written into it)
        try:
            self.folder = new_folder(target)
        except Exception as exc:
            self.error = exc

    def put(self, item: Item, tensor: torch.Tensor) -> None:
        if self.error is not None:
            return
        try:
            f, n = self.at
            if f < 0 or n == len(self.files[f]):
                self._open(f + 1)
                f, n = self.at
            assert self.files[f][n] == item, (self.files[f][n], item)
            write_tensor(self.handle, tensor.to(item.dtype))
            self.at = (f, n + 1)
        except Exception as exc:
            self.error = exc

    def _open(self, f: int) -> None:
        self._close()
        self.handle = open(self.folder / self.names[f], "wb")  # noqa: SIM115 (closed by _close)
        self.handle.write(header(self.files[f]))
        self.at = (f, 0)

    def _close(self) -> None:
        if self.handle is not None:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            self.handle = None

    def finish(self, bare: nn.Module, config: bool, dtype: torch.dtype | None) -> str:
        """Close, index, config, rename into place; ``""`` or what went wrong."""
        try:
            if self.error is not None:
                raise self.error
            self._close()
            if len(self.files) > 1:
                write_index(self.folder, self.files, self.names)
            written = set(self.names) | {"model.safetensors.index.json"}
            if config:
                written |= _write_config(bare, self.folder, dtype)
            swap_into_place(self.folder, self.target, written)
            return ""
        except Exception as exc:
            if self.handle is not None:
                self.handle.close()
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
            return f"{type(exc).__name__}: {exc}"


def _write_config(bare: nn.Module, folder: Path, dtype: torch.dtype | None) -> set[str]:
    """A Hugging Face model's config.json (its class in ``architectures``, the exported dtype)
    and generation_config.json; nothing for other models."""
    cfg = getattr(bare, "config", None)
    if not hasattr(cfg, "save_pretrained"):
        return set()
    cfg = copy.deepcopy(cfg)
    cfg.architectures = [type(bare).__name__]
    if dtype is not None and hasattr(cfg, "dtype"):
        cfg.dtype = dtype
    cfg.save_pretrained(folder)
    written = {"config.json"}
    generation = getattr(bare, "generation_config", None)
    if hasattr(generation, "save_pretrained"):
        generation.save_pretrained(folder)
        written.add("generation_config.json")
    return written
