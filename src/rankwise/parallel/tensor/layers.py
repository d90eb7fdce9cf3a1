"""Tensor-parallel layers, each built from an existing ``nn.Linear``/``nn.Embedding``.

- ``ColumnParallelLinear``: the output features are split; each rank computes its slice of the
  output from the whole input. ``f`` before (gradient all-reduced), no collective after unless
  ``gather_output``.
- ``RowParallelLinear``: the input features are split; each rank multiplies its slice of the
  input (the column layer's output, as it is) and the partial products are summed (``g``).
  The bias is whole on every rank and added once, after the sum.
- ``VocabParallelEmbedding``: the vocabulary rows are split; each rank looks up the tokens it
  holds, zeros the others, and the rows are summed (``g``).

Column then row is Megatron's pair: one all-reduce forward and one backward per pair.
With ``sequence_parallel=True`` the activations outside the pair are split along the sequence
(dim 1): the column layer all-gathers them first, the row layer (and the embedding)
reduce-scatters instead of all-reducing. The replicated parameters between the pairs (layer
norms) then see 1/size of the tokens each: their gradients must be summed over the group
(``sync_replicated_grads``).

Every layer keeps ``group``, ``tp_rank``, ``tp_size`` and ``tp_splits()``: parameter name ->
``(dim, chunks)`` (how the full tensor was cut; see ``shards``), which the checkpoint
helpers use to gather and re-slice. Constructing a layer from a module does not communicate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import validate
from .collectives import (
    copy_to_parallel,
    gather_from_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_to_parallel,
    scatter_to_parallel,
)
from .shards import Group, check_divisible, group_rank, group_size, shard

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]

Memo = dict[tuple[int, int, int], nn.Parameter]
"""Full parameter id + split -> its slice: a weight shared by two modules (tied embeddings)
stays one parameter after the split."""


def _slice_param(p: nn.Parameter, dim: int, chunks: int, group: Group, memo: Memo | None):
    key = (id(p), dim, chunks)
    if memo is not None and key in memo:
        return memo[key]
    piece = shard(p.detach(), dim, group_rank(group), group_size(group), chunks)
    out = nn.Parameter(piece, requires_grad=p.requires_grad)
    if memo is not None:
        memo[key] = out
    return out


def _check_layer(name: str, layer: object, kind: type, group: object, where: str) -> None:
    """The layer to split is an ``nn.<kind>`` and ``group`` a process group (or None)."""
    if not isinstance(layer, kind):
        validate.fail(name, layer, f"a torch.nn.{kind.__name__}", where=where,
                      fix=f"pass the nn.{kind.__name__} to split, e.g. {where[:-2]}(model.proj).")
    validate.process_group("group", group, where=where)


class _TensorParallel(nn.Module):
    """What the three layers share: the group and the split of each parameter."""

    def _set_group(self, group: Group) -> None:
        self.group = group
        self.tp_rank, self.tp_size = group_rank(group), group_size(group)

    def tp_splits(self) -> dict[str, tuple[int, int]]:
        """Parameter name -> (dim, chunks) of its split; the others are whole on every rank."""
        return dict(self._splits)

    def _keep_source(self, module: nn.Module) -> None:
        """Made from a meta module: keep it (unregistered) until ``rt.prepare`` builds it
        whole, one module at a time, and cuts this rank's pieces (``parallel/deferred``)."""
        if any(p.is_meta for p in module.parameters(recurse=False)):
            self.__dict__["_full_module"] = module

    def cut(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full parameter ``name`` (a new tensor)."""
        dim, chunks = self._splits[name]
        return shard(full, dim, self.tp_rank, self.tp_size, chunks)


class ColumnParallelLinear(_TensorParallel):
    """``y[..., slice] = x @ W[slice].T + b[slice]``: this rank's slice of the output features.

    ``chunks``: the output is ``chunks`` equal blocks split separately (3 for a fused
    ``[q; k; v]`` projection: this rank gets its heads of q, of k and of v, in that order).
    ``gather_output``: all-gather the full output (in the original feature order).
    ``in_features``/``out_features`` are this rank's (``full_out_features`` the unsplit).
    Sync point: the ranks of ``group``, in backward (and forward with ``gather_output`` or
    ``sequence_parallel``).
    """

    def __init__(
        self, linear: nn.Linear, group: Group = None, *, chunks: int = 1,
        gather_output: bool = False, sequence_parallel: bool = False, memo: Memo | None = None,
    ) -> None:  # fmt: skip
        _check_layer("linear", linear, nn.Linear, group, "ColumnParallelLinear()")
        validate.integer("chunks", chunks, minimum=1, where="ColumnParallelLinear()")
        super().__init__()
        self._set_group(group)
        self.chunks, self.gather_output, self.sequence_parallel = (
            chunks,
            gather_output,
            sequence_parallel,
        )
        self.full_out_features = linear.out_features
        per_block = check_divisible("out_features", linear.out_features, self.tp_size, chunks)
        self.in_features, self.out_features = linear.in_features, per_block * chunks
        self._splits: dict[str, tuple[int, int]] = {"weight": (0, chunks)} | (
            {"bias": (0, chunks)} if linear.bias is not None else {}
        )
        self.weight = _slice_param(linear.weight, 0, chunks, group, memo)
        self.bias = (
            None if linear.bias is None else _slice_param(linear.bias, 0, chunks, group, memo)
        )
        self._keep_source(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence(x, 1, self.group)
        else:
            x = copy_to_parallel(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output or self.tp_size == 1:
            return y
        full = gather_from_parallel(y, -1, self.group)  # rank-major: [r0 blocks, r1 blocks, ...]
        return full.unflatten(-1, (self.tp_size, self.chunks, -1)).transpose(-3, -2).flatten(-3)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(of {self.full_out_features}), chunks={self.chunks}, tp={self.tp_rank}/{self.tp_size}")  # fmt: skip


class RowParallelLinear(_TensorParallel):
    """``y = sum over ranks of x[..., slice] @ W[:, slice].T, + b``: the input features split.

    ``input_is_parallel`` (default): ``x`` is already this rank's slice (a column-parallel
    layer's output); else it is whole and sliced here. ``in_features`` is this rank's.
    Sync point: the ranks of ``group``, in forward.
    """

    def __init__(
        self, linear: nn.Linear, group: Group = None, *, input_is_parallel: bool = True,
        sequence_parallel: bool = False, memo: Memo | None = None,
    ) -> None:  # fmt: skip
        _check_layer("linear", linear, nn.Linear, group, "RowParallelLinear()")
        super().__init__()
        self._set_group(group)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.full_in_features = linear.in_features
        self.in_features = check_divisible("in_features", linear.in_features, self.tp_size)
        self.out_features = linear.out_features
        self._splits: dict[str, tuple[int, int]] = {"weight": (1, 1)}
        self.weight = _slice_param(linear.weight, 1, 1, group, memo)
        self.bias = linear.bias  # whole on every rank, added after the sum
        self._keep_source(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, -1, self.group)  # backward: the whole input's gradient
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_parallel(partial, 1, self.group)
        else:
            y = reduce_from_parallel(partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.full_in_features}), "
                f"out_features={self.out_features}, tp={self.tp_rank}/{self.tp_size}")  # fmt: skip


class VocabParallelEmbedding(_TensorParallel):
    """An embedding whose rows (the vocabulary) are split: rank r holds tokens
    ``[r * n, (r + 1) * n)``; the looked-up rows are summed over the group.

    ``max_norm`` and sparse gradients are refused (a renorm would need the whole row set).
    Sync point: the ranks of ``group``, in forward.
    """

    def __init__(
        self, embedding: nn.Embedding, group: Group = None, *, sequence_parallel: bool = False,
        memo: Memo | None = None,
    ) -> None:  # fmt: skip
        _check_layer("embedding", embedding, nn.Embedding, group, "VocabParallelEmbedding()")
        super().__init__()
        from ...errors import ConfigError

        if embedding.max_norm is not None or embedding.sparse:
            raise ConfigError(
                f"VocabParallelEmbedding cannot split an embedding with max_norm="
                f"{embedding.max_norm}, sparse={embedding.sparse}",
                fix="use max_norm=None and sparse=False, or keep this embedding whole.",
            )
        self._set_group(group)
        self.sequence_parallel = sequence_parallel
        self.full_num_embeddings = embedding.num_embeddings
        self.num_embeddings = check_divisible(
            "num_embeddings", embedding.num_embeddings, self.tp_size
        )
        self.embedding_dim = embedding.embedding_dim
        self.vocab_start = self.tp_rank * self.num_embeddings
        self._splits: dict[str, tuple[int, int]] = {"weight": (0, 1)}
        self.weight = _slice_param(embedding.weight, 0, 1, group, memo)
        self._keep_source(embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)  # also zeroes their gradient
        if self.sequence_parallel:
            return reduce_scatter_to_parallel(rows, 1, self.group)
        return reduce_from_parallel(rows, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} of {self.full_num_embeddings} rows from "
                f"{self.vocab_start}, dim {self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}")  # fmt: skip
