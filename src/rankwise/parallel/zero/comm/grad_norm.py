"""The global gradient norm over every rank's flat shards, and clipping by it.

Each rank holds a slice of every unit's averaged gradient; the global 2-norm is the root of the
sum, over ranks and units, of each slice's squared norm. Each slice's part is computed in
float64: a float32 norm of one large flat slice drifts (on CPU, a relative error of about 1e-4
over 10M elements, where torch's per-tensor norms over many small tensors stay near 1e-6), and
that error moves every clipped step. The result is cast back to the gradients' dtype, as
``torch.nn.utils.clip_grad_norm_`` returns it.

Over tensor-parallel shards (``rw.tensor_parallel`` before the engine, ``process_group`` the
mesh's data group) a shard mixes elements of split parameters, whose norm sums over the tensor
group too, with those of parameters every tensor rank holds whole, counted once:
``NormParts`` keeps the two apart (``parallel/tensor/grad_norm.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ....diagnose import fingerprints
from ...tensor.grad_norm import NormParts

if TYPE_CHECKING:
    from ..shard_unit import FlatUnit


def _pieces(units: Sequence[FlatUnit], parts: NormParts) -> Iterator[tuple[int, torch.Tensor]]:
    """``(part, slice of a shard's gradient)``: each shard cut where its parameters change
    part (runs of the same part stay one slice; the padding, zeros, joins its neighbour)."""
    for u in units:
        grad = u.shard.grad
        if grad is None:
            continue
        start, current = 0, None
        for p, off, n in zip(u.params, u.spec.offsets, u.spec.numels, strict=True):
            lo, hi = max(off, u.lo) - u.lo, min(off + n, u.hi) - u.lo
            if lo >= hi:
                continue
            part = parts.part_of(p)
            if current is not None and part != current:
                yield current, grad[start:lo]
                start = lo
            current = part
        yield (0 if current is None else current), grad[start:]


def clip_shards_(
    units: Sequence[FlatUnit],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup | None,
    model: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Scale the shards' gradients to a global norm of at most ``max_norm``; return the norm
    before clipping, the same on every rank. ``model``: the wrapped module, whose
    tensor-parallel layers say which elements are split (None: nothing is). Sync point: the
    ranks of ``group`` (and of the model's tensor-parallel groups)."""
    grads = [u.shard.grad for u in units if u.shard.grad is not None]
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    parts = NormParts(model if model is not None else torch.nn.Module())
    local = parts.local(_pieces(units, parts), norm_type, units[0].device)
    if units[0].communicates:
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        with fingerprints.collective(
            "all_reduce", local, label="gradient norm", group=group, extra=str(op)
        ):
            dist.all_reduce(local, op=op, group=group)
    powered = parts.total(local, norm_type)
    total = powered if inf else powered.pow(1.0 / norm_type)
    total = total.to(grads[0].dtype if grads else units[0].dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total
