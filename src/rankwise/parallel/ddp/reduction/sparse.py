"""Sparse gradients (``nn.Embedding(..., sparse=True)``): averaged as sparse tensors.

A sparse gradient holds only the rows a batch touched, and each rank touched different rows, so
it cannot share a flat bucket: each travels alone, as torch's DDP sends it. The all-reduce of a
sparse COO tensor (Gloo) gathers every rank's indices and values and sums them, so every rank
ends with the same sparse ``.grad``: the rows any rank touched, averaged over the world size.

They are reduced at the end of backward, after every dense bucket has been launched and in
parameter order, so every rank issues the same collectives in the same order however the
hooks fired. A communication hook sees each as a bucket of its own whose ``buffer()`` is the
sparse gradient (torch's ``GradBucket`` of a sparse parameter); its future's value becomes
``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ....diagnose import fingerprints
from ....errors import ConfigError


def sparse_flags(module: nn.Module, params: Sequence[torch.Tensor]) -> list[bool]:
    """For each of ``params``: does it get a sparse gradient? (the weight of an ``nn.Embedding``
    or ``nn.EmbeddingBag`` built with ``sparse=True``, the rule torch's DDP applies)."""
    sparse_ids = {
        id(mod.weight)
        for mod in module.modules()
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and getattr(mod, "sparse", False)
    }
    return [id(p) in sparse_ids for p in params]


class SparseBucket:
    """A sparse gradient as a communication hook sees it (torch's ``dist.GradBucket`` methods)."""

    def __init__(self, index: int, param: torch.Tensor, grad: torch.Tensor, last: bool) -> None:
        self._index, self._param, self._buffer, self._last = index, param, grad, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The sparse gradient itself (this rank's, summed, not averaged)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer]

    def parameters(self) -> list[torch.Tensor]:
        return [self._param]

    def is_last(self) -> bool:
        return self._last

    def is_the_last_bucket_to_allreduce(self) -> bool:
        return self._last


def local_grad(param: torch.Tensor, scale: float) -> torch.Tensor:
    """This rank's contribution: its sparse gradient times ``scale``, or an empty one (no row
    touched here) so that the rank still takes part in the all-reduce."""
    g = param.grad
    if g is None:
        return torch.sparse_coo_tensor(
            torch.empty(1, 0, dtype=torch.long, device=param.device),
            torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device),
            param.shape,
        )
    return g * scale if scale != 1.0 else g.clone()


def all_reduce(grad: torch.Tensor, group: Any, label: str) -> Any:
    """Start summing ``grad`` (sparse COO) over the group. Sync point: all ranks."""
    entry = fingerprints.record("all_reduce", grad, label=label, group=group, extra="sum")
    entry.watch(dist.all_reduce(grad, group=group, async_op=True))
    return entry


def hook_result(value: Any) -> torch.Tensor:
    """The tensor a communication hook's future returned for a sparse bucket."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value


def refuse_sparse(module: nn.Module, rank: int, engine: str) -> None:
    """For engines without sparse support (ZeRO's flat shards): refuse ``sparse=True``."""
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and getattr(mod, "sparse", False):
            raise ConfigError(
                f"module {name or type(mod).__name__} has sparse=True; sparse gradients are not "
                f"supported by {engine}",
                fix="construct the embedding with sparse=False (the default), or use "
                "rw.DistributedDataParallel, which averages sparse gradients.",
                rank=rank,
            )
