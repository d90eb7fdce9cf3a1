"""Which slice of a full tensor a tensor-parallel rank holds, and how the slices join again.

Pure functions (no communication): the layers slice an existing module's weights with
``shard``, the checkpoint helpers rebuild a full tensor with ``unshard`` and load a full one
with ``shard`` again, so a model saved at one tensor size loads at any other.

A split is ``(dim, chunks)``: the tensor's ``dim`` is seen as ``chunks`` equal blocks (3 for a
fused ``[q; k; v]`` projection), and every block is cut into ``size`` equal pieces; rank ``r``
holds piece ``r`` of every block, in block order. With ``chunks=1`` that is the plain
contiguous piece ``r``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...errors import ConfigError

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Ranks in ``group`` (None: the default group); 1 without a process group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside ``group``; 0 without a process group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def check_divisible(what: str, n: int, size: int, chunks: int = 1) -> int:
    """The piece length of ``n`` over ``size`` ranks (and ``chunks`` blocks), or a ConfigError."""
    if n % (size * chunks):
        blocks = f" in {chunks} blocks" if chunks > 1 else ""
        raise ConfigError(
            f"{what}={n} cannot be split evenly{blocks} over a tensor-parallel group of {size} "
            f"rank(s)",
            fix=f"use a tensor size that divides {n // chunks}, or pad {what} to a multiple of "
            f"{size * chunks} (e.g. a vocabulary of 50257 padded to 50304).",
        )
    return n // (size * chunks)


def shard(full: torch.Tensor, dim: int, rank: int, size: int, chunks: int = 1) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` along ``dim``: a new tensor, never a view (a view of
    a contiguous piece would keep the whole full tensor's storage alive)."""
    piece = check_divisible(f"size of dim {dim}", full.shape[dim], size, chunks)
    blocks = full.unflatten(dim, (chunks, size * piece))
    return blocks.narrow(dim + 1, rank * piece, piece).flatten(dim, dim + 1).clone()


def unshard(pieces: Sequence[torch.Tensor], dim: int, chunks: int = 1) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (inverse of ``shard``)."""
    blocks = [p.unflatten(dim, (chunks, -1)) for p in pieces]
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)
