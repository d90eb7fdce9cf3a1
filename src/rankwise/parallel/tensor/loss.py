"""Cross-entropy over vocabulary-parallel logits, without gathering the full logits.

Each rank holds the logits of its slice of the vocabulary (a column-parallel head with
``gather_output=False``: ``[..., V / size]``). The loss needs three numbers per token, each a
sum (or max) over the vocabulary, so each is one all-reduce of a ``[...]`` tensor instead of
an all-gather of ``[..., V]``:

    m   = max over ranks of the local max            (for a stable exp; no gradient)
    s   = sum over ranks of sum(exp(logits - m))
    z_t = sum over ranks of (logits - m)[target]     (only the rank holding the target adds)
    loss = log(s) - z_t

The sums go through ``g`` (forward all-reduce, backward identity): every rank then computes
the same loss, so the gradient of each sum reaches each rank's part whole, and autograd gives
each rank ``softmax - one_hot`` on its slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import validate
from ...errors import ConfigError
from .collectives import reduce_from_parallel
from .shards import Group, group_rank, group_size

__all__ = ["vocab_parallel_cross_entropy"]


def _check_arguments(logits: object, target: object, group: object, ignore_index: object) -> None:
    where = "rw.vocab_parallel_cross_entropy()"
    validate.tensor("logits", logits, where=where)
    validate.tensor("target", target, where=where, dtypes="int")
    if logits.dim() != target.dim() + 1:
        raise ConfigError(
            f"{where}: logits of shape {tuple(logits.shape)} and target of shape "
            f"{tuple(target.shape)}: logits need one more dimension (this rank's classes)",
            fix="pass logits [..., V / tensor size] and target [...] (class indices).",
        )
    validate.process_group("group", group, where=where)
    validate.integer("ignore_index", ignore_index, where=where, example=-100)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: Group = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits.flatten(0, -2), target.flatten())`` from this rank's
    slice ``logits[..., V / size]`` (rank r holds classes ``[r * V/size, (r + 1) * V/size)``).

    ``reduction``: 'mean' (over targets that are not ``ignore_index``), 'sum' or 'none'.
    Every rank returns the same loss. Sync point: the ranks of ``group`` (3 all-reduces).
    """
    _check_arguments(logits, target, group, ignore_index)
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(
            f"reduction={reduction!r} is not one of 'mean', 'sum', 'none'",
            fix="pass reduction='mean' (the default), 'sum' or 'none'.",
        )
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    local_vocab = logits.shape[-1]
    start = group_rank(group) * local_vocab
    peak = logits.detach().amax(dim=-1)
    if group_size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    total = reduce_from_parallel(shifted.exp().sum(dim=-1), group)
    local_target = target - start
    here = (local_target >= 0) & (local_target < local_vocab)
    picked = shifted.gather(-1, local_target.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_parallel(picked.masked_fill(~here, 0.0), group)
    loss = total.log() - picked
    counted = target != ignore_index
    loss = loss.masked_fill(~counted, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / counted.sum()
