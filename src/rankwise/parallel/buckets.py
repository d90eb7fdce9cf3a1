"""Pure bucket assignment: which gradients travel together in one all-reduce.

Backward produces gradients roughly in the reverse of the order in which parameters were
registered (the last layer's first). Walking the parameters in that reverse order and cutting
a bucket whenever it reaches its size cap means that bucket 0 is complete first, bucket 1 next,
and so on, so each all-reduce can start while backward still computes the earlier layers.

The first bucket is small (1 MiB, torch's default as well): the gradients computed first should
go on the wire at once rather than wait for 25 MiB of company. Parameters of different dtypes
or devices never share a bucket (one flat buffer has one dtype and lives on one device).

Nothing here touches ``torch.distributed``; it is a function from shapes to index lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError

MB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_BYTES = 1 * MB
"""Cap of the first bucket of each dtype/device (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``)."""
SOLO_BYTES = 4 * MB
"""A gradient at least this large travels alone: the reducer all-reduces it where autograd put
it instead of copying it into a flat buffer (copying 4 MiB costs more than one more message)."""


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One flat buffer's worth of gradients, reduced by one collective."""

    indices: tuple[int, ...]
    """Positions of the bucket's parameters in the parameter list, in bucket layout order."""
    offsets: tuple[int, ...]
    """Element offset of each parameter's gradient inside the flat buffer."""
    numel: int
    """Total number of elements of the flat buffer."""
    dtype: torch.dtype
    """Element type shared by every gradient of the bucket."""
    device: torch.device
    """Device shared by every gradient of the bucket."""

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def assign_buckets(
    params: Sequence[torch.Tensor],
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    first_bucket_bytes: int | None = FIRST_BUCKET_BYTES,
    solo_bytes: int | None = None,
) -> list[Bucket]:
    """Group ``params`` into buckets in the order their gradients are expected to be ready.

    Parameters are taken in reverse registration order; a bucket is closed as soon as it holds
    at least its cap in bytes (``first_bucket_bytes`` for the first bucket of each dtype/device,
    ``bucket_cap_mb`` MiB afterwards), so a parameter larger than the cap gets a bucket of its
    own. ``first_bucket_bytes=None`` uses the normal cap for the first bucket too. A parameter of
    ``solo_bytes`` or more gets a bucket of its own; the open one stays open for smaller ones.
    Buckets are ordered by when they should complete: bucket 0 holds the last parameters.
    """
    if not bucket_cap_mb > 0:
        raise ConfigError(
            f"bucket_cap_mb={bucket_cap_mb!r} must be a positive number of MiB",
            fix="use e.g. bucket_cap_mb=25 (the default); larger buckets mean fewer, later "
            "all-reduces.",
        )
    cap = int(bucket_cap_mb * MB)
    first_cap = cap if first_bucket_bytes is None else min(int(first_bucket_bytes), cap)
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_before: set[tuple[torch.dtype, torch.device]] = set()
    # (position in the reversed walk of the bucket's last parameter, its indices): the order
    # in which the buckets should complete, hence the order their all-reduces are issued.
    done: list[tuple[int, list[int]]] = []
    last: dict[tuple[torch.dtype, torch.device], int] = {}
    for step, index in enumerate(reversed(range(len(params)))):
        p = params[index]
        key = (p.dtype, p.device)
        if solo_bytes is not None and p.numel() * p.element_size() >= solo_bytes:
            done.append((step, [index]))
            closed_before.add(key)
            continue
        if key not in open_buckets:
            open_buckets[key], open_bytes[key] = [], 0
        open_buckets[key].append(index)
        open_bytes[key] += p.numel() * p.element_size()
        last[key] = step
        limit = cap if key in closed_before else first_cap
        if open_bytes[key] >= limit:
            done.append((step, open_buckets.pop(key)))
            del open_bytes[key]
            closed_before.add(key)
    done.extend((last[key], indices) for key, indices in open_buckets.items())
    done.sort(key=lambda item: item[0])
    return [_layout(params, indices) for _, indices in done]


def _layout(params: Sequence[torch.Tensor], indices: list[int]) -> Bucket:
    offsets, total = [], 0
    for i in indices:
        offsets.append(total)
        total += params[i].numel()
    first = params[indices[0]]
    return Bucket(
        indices=tuple(indices),
        offsets=tuple(offsets),
        numel=total,
        dtype=first.dtype,
        device=first.device,
    )
