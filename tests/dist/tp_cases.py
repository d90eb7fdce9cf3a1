"""Shared pieces of the tensor-parallel tests: compare a split module with the unsplit one.

Every rank builds the unsplit module from the same seed, runs it on the same input, and
compares its own slice of every output and gradient with the matching slice of the unsplit
module's (``shard`` of the full gradient for split parameters, the whole for the others).
"""

from __future__ import annotations

import copy

import torch

from rankwise.parallel.tensor.shards import shard


def split_of(model: torch.nn.Module, param_name: str):
    """(layer, dim, chunks) when ``param_name`` is split by a tensor-parallel layer, else None."""
    owner, _, attr = param_name.rpartition(".")
    layer = model.get_submodule(owner) if owner else model
    if hasattr(layer, "tp_splits") and attr in layer.tp_splits():
        return (layer, *layer.tp_splits()[attr])
    return None


def local_view(model, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the unsplit model's tensor ``name``."""
    found = split_of(model, name)
    if found is None:
        return full
    layer, dim, chunks = found
    return shard(full, dim, layer.tp_rank, layer.tp_size, chunks)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def compare(reference, split, inputs, loss_ref, loss_split, out_view=lambda t: t) -> dict:
    """Forward + backward on both; ``{what: max |delta|}`` over the output, the input's
    gradient (for float inputs) and every parameter's gradient (this rank's slice)."""
    x_ref = inputs.clone().requires_grad_(inputs.is_floating_point())
    x_tp = inputs.clone().requires_grad_(inputs.is_floating_point())
    out_ref, out_tp = _logits(reference(x_ref)), _logits(split(x_tp))
    loss_ref(out_ref).backward()
    loss_split(out_tp).backward()
    diffs = {"output": max_diff(out_view(out_ref), out_tp)}
    if inputs.is_floating_point():
        diffs["input.grad"] = max_diff(x_ref.grad, x_tp.grad)
    full = dict(reference.named_parameters())
    for name, p in split.named_parameters():
        diffs[f"{name}.grad"] = max_diff(local_view(split, name, full[name].grad), p.grad)
    return diffs


def _logits(out):
    return out[0] if isinstance(out, tuple) else out  # rankwise.models.GPT: (logits, loss)


def twins(module):
    """The module and a deep copy to be split (same weights)."""
    return module, copy.deepcopy(module)
