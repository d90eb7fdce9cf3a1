"""``rw.load_pretrained(model, path)``: a Hugging Face checkpoint straight into this rank's part.

The model is prepared first (``rt.prepare``: ZeRO, DDP, a mesh; or a bare model), so every
rank knows which part of each tensor it keeps; each rank then reads only that part from the
safetensors files, one tensor at a time:

- ZeRO-3: this rank's flat range of each parameter (a range of rows plus partial rows);
- tensor parallelism: this rank's columns, rows or vocabulary slice (a fused q/k/v projection:
  its heads of q, of k and of v);
- every other strategy (single, dp, ddp, zero1, zero2): the whole tensor.

So the memory a load needs on top of the prepared model is one tensor's slice at most, never
the file. What is read is converted to the model's dtype (a bf16 file into fp32 parameters).
Names are matched as ``keys.py`` says; a tensor the file lacks or one the model has no place
for is a ``ConfigError`` naming them (``strict=False``: reported in the result instead), a
shape that differs always is.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ...comm import collectives as comm
from ...comm import wire
from ...errors import ConfigError, DistributedError
from ...output.log import get_logger
from ..state_dict import registered_inner
from .keys import KeyMap, resolve
from .source import DTYPES, Entry, Source
from .targets import Target, fill, is_split, model_targets, needs_read, wrappers, zero_engine


@dataclass(frozen=True)
class PretrainedLoad:
    """What ``load_pretrained`` did on this rank."""

    missing_keys: list[str]
    """Model tensors the checkpoint did not fill (only with ``strict=False``)."""
    unexpected_keys: list[str]
    """Checkpoint tensors the model has no place for (only with ``strict=False``)."""
    loaded: int
    """Model tensors filled from the checkpoint."""
    read_bytes: int
    """Bytes this rank read from the files (ZeRO-3 at N ranks: about 1/N of them)."""
    total_bytes: int
    """Bytes of the checkpoint's tensors that were loaded (the whole of each)."""


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    key_map: KeyMap = None,
    strict: bool = True,
) -> PretrainedLoad:
    """Fill ``model`` (prepared or bare) from the safetensors checkpoint at ``path``: a
    ``.safetensors`` file, ``model.safetensors.index.json``, or the folder holding either.

    ``key_map``: file name -> model name, as a function (None skips the tensor) or
    ``{regex: replacement}`` (docs/pretrained.md). ``strict``: missing and unexpected tensors
    are an error (else listed in the result).

    Sync point: all ranks when ``model`` is prepared for several processes (every rank holds a
    part; they agree on the outcome, so a rank that fails fails them all); none for a bare model.
    """
    together = comm.world_size() > 1 and _spans_ranks(model)
    if together:  # zero3's shared units (one machine): nobody reads them while they change
        from ...parallel.zero.comm import node_shared

        node_shared.before_write(zero_engine(model))
    try:
        result = _load(model, Path(path), key_map, strict)
    except Exception as exc:
        if together:
            _agree(str(exc).splitlines()[0])
        raise
    if together:
        _agree(None)
    if comm.rank() == 0:
        get_logger("rankwise.pretrained").info(
            f"rankwise load_pretrained: {result.loaded} tensors from {os.fspath(path)!r}; "
            f"rank 0 read {result.read_bytes / 2**20:.1f} of {result.total_bytes / 2**20:.1f} MiB"
        )
    return result


def _spans_ranks(model: nn.Module) -> bool:
    """A model wrapped by a multi-process engine (DDP, ZeRO) or split by tensor parallelism."""
    return any(hasattr(m, "process_group") for m in wrappers(model)) or is_split(model)


def _agree(error: str | None) -> None:
    """Every rank's outcome on every rank; a peer's failure raised here too. Sync point: all
    ranks."""
    outcomes = wire.all_gather_json(error or "", label="load_pretrained outcome")
    failed = [(r, m) for r, m in enumerate(outcomes) if m]
    if error is None and failed:
        rank, message = failed[0]
        raise DistributedError(
            f"load_pretrained failed on rank(s) {[r for r, _ in failed]}; rank {rank}: "
            f"{str(message)[:400]}",
            fix="see that rank's error (every rank must read the same checkpoint).",
            rank=comm.rank(),
        )


def _load(model: nn.Module, path: Path, key_map: KeyMap, strict: bool) -> PretrainedLoad:
    source = Source(path)
    bare = registered_inner(model)
    targets = model_targets(model)
    names = {n for t in targets for n in t.names}
    resolution = resolve(
        source.entries, names, key_map=key_map,
        prefix=getattr(bare, "base_model_prefix", None) or None,
        ignore=_patterns(bare, "_keys_to_ignore_on_load_unexpected"),
    )  # fmt: skip
    plan, missing = [], []
    ignore_missing = [re.compile(p) for p in _patterns(bare, "_keys_to_ignore_on_load_missing")]
    for t in targets:
        key = next((resolution.chosen[n] for n in t.names if n in resolution.chosen), None)
        if key is not None:
            plan.append((t, key))
        elif not any(p.search(n) for n in t.names for p in ignore_missing):
            missing.append(t.names[0])
    if strict and (missing or resolution.unexpected):
        raise _names_error(path, bare, missing, resolution.unexpected, source, names)
    for t, key in plan:
        _check(t, key, source.entries[key])
    read = total = 0
    order = {file: i for i, file in enumerate(source.files)}
    for t, key in sorted(plan, key=lambda pair: order[source.entries[pair[1]].file]):
        size = DTYPES[source.entries[key].dtype].itemsize
        total += _numel(source.entries[key].shape) * size
        if needs_read(t):
            with source.reader(key) as reader:
                read += fill(t, reader) * size
    return PretrainedLoad(missing, resolution.unexpected, len(plan), read, total)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _patterns(bare: nn.Module, attr: str) -> list[str]:
    value = getattr(bare, attr, None) or ()
    return [p for p in value if isinstance(p, str)]


def _names_error(
    path: Path, bare: nn.Module, missing: list[str], unexpected: list[str], source: Source,
    names: set[str],
) -> ConfigError:  # fmt: skip
    parts = []
    if missing:
        parts.append(f"lacks {len(missing)} tensor(s) of the model: {missing[:6]}")
    if unexpected:
        parts.append(f"holds {len(unexpected)} tensor(s) the model has no place for: "
                     f"{unexpected[:6]}")  # fmt: skip
    example_file = (unexpected or sorted(source.entries))[0]
    example_model = (missing or sorted(names))[0]
    return ConfigError(
        f"the checkpoint {os.fspath(path)!r} {' and '.join(parts)} ({type(bare).__name__}; file "
        f"names look like {example_file!r}, the model's like {example_model!r})",
        fix="map the file's names to the model's with key_map= (a function name -> name, or "
        "{regex: replacement}), or pass strict=False to keep what the file lacks as "
        "initialised and skip the rest.",
    )


def _check(target: Target, key: str, entry: Entry) -> None:
    name = target.names[0]
    if entry.shape != target.full_shape:
        raise ConfigError(
            f"tensor {key!r} in {entry.file.name} has shape {list(entry.shape)}, but the "
            f"model's {name} is {list(target.full_shape)} (unsplit)",
            fix="load a checkpoint of the same configuration (its config.json), or skip this "
            "tensor with key_map returning None for it and strict=False.",
        )
    dtype = DTYPES.get(entry.dtype)
    have = target.tensor.dtype
    same_kind = dtype is not None and (
        dtype == have or (dtype.is_floating_point and have.is_floating_point)
    )
    if not same_kind:
        raise ConfigError(
            f"tensor {key!r} in {entry.file.name} is {entry.dtype}, but the model's {name} is "
            f"{have}; only floating-point tensors are converted (and these dtypes are read: "
            f"{sorted(DTYPES)})",
            fix="build the model with the checkpoint's dtypes for this tensor, or skip it with "
            "key_map and strict=False.",
        )
