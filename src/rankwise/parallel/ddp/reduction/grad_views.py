"""Where a gradient lives during the all-reduce: a slot of a flat bucket, or where it is.

A slot keeps the parameter's memory layout (autograd's layout contract), and a gradient can be
reduced where autograd left it only if it is dense and matches its bucket's dtype and device.
"""

from __future__ import annotations

import warnings

import torch

from ...buckets import Bucket


def _is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill its storage without gaps or overlap (in some order)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def grad_view(flat: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """The slot of ``flat`` that holds ``param``'s gradient, with ``param``'s strides.

    Gradients follow their parameter's memory layout (autograd's layout contract; e.g. a
    channels_last convolution weight), so the view takes the parameter's strides when they
    are dense, and plain contiguous strides otherwise.
    """
    n = param.numel()
    if param.is_contiguous() or not _is_dense(param):
        return flat[offset : offset + n].view(param.shape)
    return flat.as_strided(param.shape, param.stride(), flat.storage_offset() + offset)


def reducible_in_place(g: torch.Tensor, bucket: Bucket) -> bool:
    """``g`` can be all-reduced where it is: dense, same dtype and device as its bucket."""
    return (
        g.is_contiguous()
        and not g.requires_grad
        and g.dtype == bucket.dtype
        and g.device == bucket.device
        and g.layout == torch.strided
    )


_warned_create_graph = False


def copy_higher_order(g: torch.Tensor, scale: float, view: torch.Tensor) -> None:
    """``view = g * scale`` for a gradient that requires grad (``backward(create_graph=True)``).

    The averaged gradient is a plain tensor, as in torch's DDP: the higher-order graph of a
    gradient does not survive the all-reduce, which is why torch warns, and so do we.
    """
    global _warned_create_graph
    if g.requires_grad and not _warned_create_graph:
        _warned_create_graph = True
        warnings.warn(
            "Using DistributedDataParallel with create_graph=True is not recommended: the "
            "averaged gradients carry no autograd graph (as in torch's DistributedDataParallel)",
            stacklevel=3,
        )
    with torch.no_grad():
        torch.mul(g.detach(), scale, out=view)
