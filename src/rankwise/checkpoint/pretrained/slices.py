"""Which part of a file's tensor this rank needs, read as a few rectangular slices (pure).

A model tensor on this rank is the file's tensor, or a tensor-parallel piece of it (a
``Split``: the tensor's ``dim`` seen as ``chunks`` equal blocks, each cut into ``size`` pieces;
rank ``r`` holds piece ``r`` of every block, in block order, as ``parallel/tensor/shards``
cuts it). ZeRO-3 keeps a flat range ``[a, b)`` of that (local) tensor's elements: a range of
rows (the first dimension) plus partial rows at both ends. ``copy_range`` reads exactly the
rows that range touches, slice by slice through ``read`` (safetensors' ``get_slice(name)[...]``,
or a tensor's own ``__getitem__`` in tests), and copies the range into ``out``, converting the
dtype on the way. Nothing else of the file's tensor is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Read = Callable[[tuple], torch.Tensor]
"""``read(index)``: the file tensor indexed by a tuple of slices (leading dimensions)."""


@dataclass(frozen=True)
class Split:
    """How tensor parallelism cut a tensor: ``dim``, ``chunks`` blocks, this ``rank`` of ``size``."""

    dim: int
    chunks: int
    rank: int
    size: int


def local_shape(full: Sequence[int], split: Split | None) -> tuple[int, ...]:
    """The shape this rank holds of a tensor whose unsplit shape is ``full``."""
    shape = list(full)
    if split is not None and split.size > 1:
        shape[split.dim] //= split.size
    return tuple(shape)


def _split_rows(read: Read, full: Sequence[int], split: Split, r0: int, r1: int) -> list:
    """Rows ``[r0, r1)`` of the local tensor, as file slices to concatenate (split on dim 0)."""
    block = full[0] // split.chunks
    piece = block // split.size
    parts, i = [], r0
    while i < r1:
        k, j = divmod(i, piece)  # local row i is row j of this rank's piece of block k
        end = min(r1, (k + 1) * piece)
        start = k * block + split.rank * piece + j
        parts.append(read((slice(start, start + end - i),)))
        i = end
    return parts


def local_rows(read: Read, full: Sequence[int], split: Split | None, r0: int, r1: int):
    """Rows ``[r0, r1)`` (first dimension) of this rank's local tensor, read from the file."""
    if split is None or split.size == 1:
        return read((slice(r0, r1),))
    if split.dim == 0:
        parts = _split_rows(read, full, split, r0, r1)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    d = split.dim
    block = full[d] // split.chunks
    piece = block // split.size
    lead = (slice(r0, r1),) + (slice(None),) * (d - 1)
    parts = [
        read((*lead, slice(k * block + split.rank * piece, k * block + (split.rank + 1) * piece)))
        for k in range(split.chunks)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def copy_range(
    read: Read, full: Sequence[int], split: Split | None, a: int, b: int, out: torch.Tensor
) -> int:
    """Copy elements ``[a, b)`` of the flattened local tensor into the 1-D ``out``; returns
    the number of file elements read (the rows the range touches)."""
    if b <= a:
        return 0
    shape = local_shape(full, split)
    if not shape:  # a 0-d tensor: the whole of it
        value = read(())
        out.copy_(value.reshape(-1))
        return 1
    row = math.prod(shape[1:])
    r0, r1 = a // row, -(-b // row)
    rows = local_rows(read, full, split, r0, r1)
    out.copy_(rows.reshape(-1)[a - r0 * row : b - r0 * row])
    return rows.numel()


def shard_overlap(offset: int, numel: int, lo: int, hi: int) -> tuple[int, int]:
    """The part ``[a, b)`` of a parameter laid at ``[offset, offset + numel)`` of a flat unit
    that falls in this rank's shard ``[lo, hi)``, in the parameter's own element numbering
    (``a >= b``: none of it)."""
    return max(offset, lo) - offset, min(offset + numel, hi) - offset
