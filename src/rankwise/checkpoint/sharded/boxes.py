"""Rectangular pieces of tensors: the geometry of a sharded checkpoint (pure, no I/O).

torch's DCP format stores each tensor as *chunks*: rectangles of the full tensor, each with an
offset and a size per dimension. What a rank holds is rarely one rectangle:

- ZeRO's flat shards cut the parameters laid end to end, so a rank's share of one parameter
  is a contiguous range of its row-major elements. ``flat_range_boxes`` cuts such a range
  into the few rectangles it is made of (a partial first row, whole rows, a partial last row,
  recursively for more dimensions); each rectangle is also a contiguous run of elements, so
  its data is a plain view of the flat shard.
- Tensor parallelism gives a rank piece ``r`` of every block along one dimension
  (``parallel/tensor/shards.py``); ``to_global`` moves a rectangle in the local slice's
  coordinates to the full tensor's, cutting it where the blocks end.

``overlap`` intersects two rectangles (a saved chunk with a piece a rank wants), which is all
a resharding load needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A rectangle of a tensor: ``offsets`` and ``sizes`` per dimension (empty for a scalar)."""

    offsets: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """The rectangles made of elements ``[start, stop)`` of a row-major tensor of ``shape``,
    in order, each with the flat index of its first element. Consecutive, disjoint, covering
    the range exactly; a scalar (``shape == ()``) is one empty rectangle."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [(Box((), ()), 0)]
    if len(shape) == 1:
        return [(Box((start,), (stop - start,)), start)]
    row = numel(shape[1:])
    out: list[tuple[Box, int]] = []
    if start % row:  # a partial first row
        r = start // row
        end = min(stop, (r + 1) * row)
        out += _in_row(shape, r, start - r * row, end - r * row)
        start = end
    whole = (stop - start) // row
    if whole:
        rest = (0,) * (len(shape) - 1)
        out.append((Box((start // row, *rest), (whole, *shape[1:])), start))
        start += whole * row
    if start < stop:  # a partial last row
        r = start // row
        out += _in_row(shape, r, 0, stop - r * row)
    return out


def _in_row(shape: Shape, r: int, lo: int, hi: int) -> list[tuple[Box, int]]:
    row = numel(shape[1:])
    inner = flat_range_boxes(shape[1:], lo, hi)
    return [(Box((r, *b.offsets), (1, *b.sizes)), r * row + first) for b, first in inner]


def overlap(a: Box, b: Box) -> Box | None:
    """The rectangle both ``a`` and ``b`` cover, or None."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class Split:
    """How a tensor-parallel rank's slice sits in the full tensor (``tp_splits``' ``(dim,
    chunks)``, the rank and the group size, and the slice's length along ``dim``): ``dim`` is
    seen as ``chunks`` blocks, and the rank holds piece ``rank`` of ``size`` of every block."""

    dim: int
    chunks: int
    rank: int
    size: int
    local_len: int

    def full_shape(self, local: Sequence[int]) -> Shape:
        out = list(local)
        out[self.dim] *= self.size
        return tuple(out)

    def to_global(self, box: Box) -> list[tuple[Box, int, int]]:
        """``box`` (in the local slice) as rectangles of the full tensor: ``(global box,
        start along dim inside ``box``, length)`` for each block it touches, in order."""
        piece = self.local_len // self.chunks
        a = box.offsets[self.dim]
        end = a + box.sizes[self.dim]
        out = []
        while a < end:
            block = a // piece
            stop = min(end, (block + 1) * piece)
            offsets, sizes = list(box.offsets), list(box.sizes)
            offsets[self.dim] = (block * self.size + self.rank) * piece + (a - block * piece)
            sizes[self.dim] = stop - a
            out.append((Box(tuple(offsets), tuple(sizes)), a - box.offsets[self.dim], stop - a))
            a = stop
        return out


def tiling_problem(shape: Shape, boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly (each inside it, none
    overlapping another, together every element), or None when they do. A chunk listed twice,
    one that overlaps another or a gap would make a load copy some elements twice and leave
    others as they were: uninitialised memory, in a fresh tensor."""
    if any(d < 0 for d in shape):
        return f"has the negative shape {list(shape)}"
    for b in boxes:
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(b.offsets, b.sizes, shape,
                                                                strict=True)):  # fmt: skip
            return f"has a chunk at {list(b.offsets)} of size {list(b.sizes)} outside its shape"
    filled = [b for b in boxes if b.numel]
    if not shape:  # a scalar: one chunk
        return None if len(filled) == 1 else f"has {len(filled)} chunks for one scalar"
    # sweep along the dimension where the chunks start at the most places: few comparisons
    dim = max(range(len(shape)), key=lambda d: len({b.offsets[d] for b in filled}))
    order = sorted(filled, key=lambda b: b.offsets[dim])
    for i, a in enumerate(order):
        end = a.offsets[dim] + a.sizes[dim]
        for b in order[i + 1 :]:
            if b.offsets[dim] >= end:
                break
            if overlap(a, b) is not None:
                return (f"has overlapping chunks at {list(a.offsets)} (size {list(a.sizes)}) "
                        f"and {list(b.offsets)} (size {list(b.sizes)})")  # fmt: skip
    covered = sum(b.numel for b in filled)
    if covered != numel(shape):
        return f"has chunks covering {covered} of its {numel(shape)} elements"
    return None
