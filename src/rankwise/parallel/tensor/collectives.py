"""The four collectives of tensor parallelism, as autograd functions (forward and backward).

Megatron-LM's names, and what each does to a tensor and its gradient:

- ``copy_to_parallel`` ("f"): forward identity, backward all-reduce. Before a column-parallel
  layer: every rank reads the same input, and the input's gradient is the sum of every
  rank's part.
- ``reduce_from_parallel`` ("g"): forward all-reduce, backward identity. After a row-parallel
  layer: the partial products are summed; every rank then computes the same thing downstream,
  so the gradient is already whole.
- ``gather_from_parallel`` / ``scatter_to_parallel``: all-gather along a dimension, backward
  this rank's slice of the gradient; and the reverse.
- ``reduce_scatter_to_parallel`` / ``gather_from_sequence`` (sequence parallelism): forward
  reduce-scatter along the sequence, backward all-gather; and the reverse.

Every function is the identity at group size 1 (and without a process group).
Sync point: the ranks of ``group``, for every call (forward and backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...diagnose import fingerprints
from ...timing import clock as timing
from .shards import Group, check_divisible, group_rank, group_size

__all__ = [
    "copy_to_parallel",
    "gather_from_parallel",
    "gather_from_sequence",
    "reduce_from_parallel",
    "reduce_scatter_to_parallel",
    "scatter_to_parallel",
]


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()  # never in place: autograd may still hold ``x``
    # Recorded like every collective rankwise issues: a rank that never comes (stuck in its
    # DataLoader) is then reported, and the job ended, instead of waiting for the timeout.
    with (
        fingerprints.collective("all_reduce", out, label="tensor parallel", group=group),
        timing.span("blocked", any_thread=True),  # the step anatomy: waiting for the group
    ):
        dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    first = x.movedim(dim, 0).contiguous()
    out = first.new_empty((size * first.shape[0], *first.shape[1:]))
    with (
        fingerprints.collective("all_gather", first, label="tensor parallel", group=group),
        timing.span("blocked", any_thread=True),
    ):
        dist.all_gather_single(out, first, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    first = x.movedim(dim, 0).contiguous()
    piece = check_divisible(f"size of dim {dim}", first.shape[0], size)
    out = first.new_empty((piece, *first.shape[1:]))
    with (
        fingerprints.collective("reduce_scatter", first, label="tensor parallel", group=group),
        timing.span("blocked", any_thread=True),
    ):
        dist.reduce_scatter_single(out, first, group=group)
    return out.movedim(0, dim)


def _slice(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    size = group_size(group)
    piece = check_divisible(f"size of dim {dim}", x.shape[dim], size)
    return x.narrow(dim, group_rank(group) * piece, piece).contiguous()


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.dim, ctx.group), None, None


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce (sum) of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Megatron's g: all-reduce (sum) forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, dim: int = -1, group: Group = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); backward: this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromParallel.apply(x, dim % x.dim(), group)


def scatter_to_parallel(x: torch.Tensor, dim: int = -1, group: Group = None) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim``; backward: all-gather of the gradient."""
    return x if group_size(group) == 1 else _ScatterToParallel.apply(x, dim % x.dim(), group)


def reduce_scatter_to_parallel(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """Sum over ranks, keep this rank's slice along ``dim`` (the sequence); backward all-gather."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToParallel.apply(x, dim % x.dim(), group)


def gather_from_sequence(x: torch.Tensor, dim: int = 1, group: Group = None) -> torch.Tensor:
    """All-gather the sequence slices along ``dim``; backward: reduce-scatter of the gradient."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, dim % x.dim(), group)
