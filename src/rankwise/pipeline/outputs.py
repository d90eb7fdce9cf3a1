"""A pipelined model's call: the batch cut into micro-batches, the outputs put back together.

Every rank of a pipeline reads the same batch (``rt.prepare`` splits the loader over the data
dimension only), so every rank cuts the call's arguments the same way: each tensor whose first
dimension is the batch's is split along it, anything else goes to every micro-batch whole.

The output: what the model returns, either its loss (a one-element tensor) or a tuple/list
holding it (``logits, loss = model(x, y)``). ``Outputs`` describes that shape in three numbers
so the stages that never see the output (all but the last) can return the same structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Outputs:
    """An output's structure: ``kind`` 0 (the loss itself), 1 (tuple), 2 (list) or 3 (other);
    ``length`` of a tuple/list; ``loss_index`` of the loss in it (-1: none)."""

    kind: int
    length: int = 1
    loss_index: int = 0


@dataclass
class MicroInputs:
    """A call's arguments cut into micro-batches."""

    args: list[tuple] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)
    targets: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def _batch_size(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ConfigError(
        "a pipelined model was called without a batch tensor",
        fix="call it with the batch: model(x, y) (dimension 0 = samples).",
    )


def split_inputs(args: tuple, kwargs: dict, chunks: int, *, with_target: bool) -> MicroInputs:
    """The call ``model(*args, **kwargs)`` as ``min(chunks, batch)`` micro-batch calls; with
    ``with_target`` the last positional argument is the target (for ``loss_fn``)."""
    targets: Any = None
    if with_target:
        if len(args) < 2:
            raise ConfigError(
                f"a pipelined model prepared with loss_fn= got {len(args)} positional "
                "argument(s); it is called as model(x, y), y the target of loss_fn",
                fix="pass the batch and its targets: loss = model(x, y).",
            )
        args, targets = args[:-1], args[-1]
    batch = _batch_size(args, kwargs)
    count = max(1, min(chunks, batch))

    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return list(torch.tensor_split(value, count, dim=0))
        return [value] * count

    cut_args = [cut(a) for a in args]
    cut_kwargs = {k: cut(v) for k, v in kwargs.items()}
    out = MicroInputs(
        args=[tuple(a[i] for a in cut_args) for i in range(count)],
        kwargs=[{k: v[i] for k, v in cut_kwargs.items()} for i in range(count)],
        targets=cut(targets) if with_target else [None] * count,
    )
    out.sizes = [len(t) for t in torch.tensor_split(torch.arange(batch), count)]
    return out


def _is_loss(value: Any, train: bool) -> bool:
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        return False
    return value.requires_grad or not train


def structure_of(out: Any, *, train: bool) -> Outputs:
    """``out``'s structure; in training, an error unless it holds exactly one loss."""
    if _is_loss(out, train) and out.dim() == 0:
        return Outputs(0)
    if isinstance(out, (tuple, list)):
        found = [k for k, v in enumerate(out) if _is_loss(v, train) and v.dim() == 0]
        if len(found) == 1 or (not train and not found):
            return Outputs(1 if isinstance(out, tuple) else 2, len(out), found[0] if found else -1)
    if not train:
        return Outputs(3, 1, -1)
    raise ConfigError(
        f"a pipelined model must return its loss in training (one 0-dim tensor, alone or in a "
        f"tuple/list); it returned {type(out).__name__}",
        fix="call it with the targets so that it computes the loss (logits, loss = model(x, "
        "y)), or pass loss_fn= to rt.prepare for a model that returns outputs (then loss = "
        "model(x, y)).",
    )


def rebuild(shape: Outputs, loss: torch.Tensor | None) -> Any:
    """The output as the stages without it return it: the loss in place, None elsewhere."""
    if shape.kind == 0:
        return loss
    if shape.kind == 3:
        return None
    items = [None] * shape.length
    if shape.loss_index >= 0:
        items[shape.loss_index] = loss
    return tuple(items) if shape.kind == 1 else items


def merge(outputs: list[Any], weights: Sequence[float]) -> Any:
    """Micro-batch outputs as one batch's: batch tensors concatenated, 0-dim ones (losses)
    weighted, tuples/lists element by element."""
    if not outputs:
        return None
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return sum(w * o for w, o in zip(weights, outputs, strict=True))
        return torch.cat(outputs, dim=0)
    if isinstance(first, (tuple, list)):
        parts = [merge([o[k] for o in outputs], weights) for k in range(len(first))]
        return tuple(parts) if isinstance(first, tuple) else parts
    return first if len(outputs) == 1 else None
