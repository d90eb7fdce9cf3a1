"""The global gradient norm over every rank's flat shards, and clipping by it.

Each rank holds a slice of every unit's averaged gradient; the global 2-norm is the root of the
sum, over ranks and units, of each slice's squared norm. Each slice's part is computed in
float64: a float32 norm of one large flat slice drifts (on CPU, a relative error of about 1e-4
over 10M elements, where torch's per-tensor norms over many small tensors stay near 1e-6), and
that error moves every clipped step. The result is cast back to the gradients' dtype, as
``torch.nn.utils.clip_grad_norm_`` returns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...diagnose import fingerprints

if TYPE_CHECKING:
    from .shard_unit import FlatUnit


def clip_shards_(
    units: Sequence[FlatUnit], max_norm: float, norm_type: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Scale the shards' gradients to a global norm of at most ``max_norm``; return the norm
    before clipping, the same on every rank. Sync point: the ranks of ``group``."""
    grads = [u.shard.grad for u in units if u.shard.grad is not None]
    device = units[0].device
    norm_type = float(norm_type)
    if grads:
        norms = torch.stack(
            [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
        )
    else:
        norms = torch.zeros(1, device=device, dtype=torch.float64)
    if norm_type == float("inf"):
        local, op = norms.max(), dist.ReduceOp.MAX
    else:
        local, op = norms.pow(norm_type).sum(), dist.ReduceOp.SUM
    if units[0].communicates:
        with fingerprints.collective(
            "all_reduce", local, label="gradient norm", group=group, extra=str(op)
        ):
            dist.all_reduce(local, op=op, group=group)
    total = local if norm_type == float("inf") else local.pow(1.0 / norm_type)
    total = total.to(grads[0].dtype if grads else units[0].dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total
