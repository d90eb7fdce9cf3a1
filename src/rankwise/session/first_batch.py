"""The first training step under a multi-process strategy: do the ranks read different data?

A DataLoader that did not go through ``rt.prepare`` (nor ``rw.loader``, a ``DistributedSampler``
or an ``rw.ShardedIterable``) gives every rank the whole data set: N times the work per epoch,
and nothing fails. ``watch(rt, model)`` puts a forward pre-hook on the prepared model which, at
the first forward in training mode with gradients on (every rank gets there: the backward that
follows is a sync point), looks at two things, then removes itself:

- the loaders the user's loop holds (the locals of the frame that called the model, and those
  of its ``self``): a map-style ``DataLoader`` without a distributed sampler, while none of them
  splits the data, is the mistake itself, whatever order each rank shuffled its copy in;
- the batch: a small fingerprint of the inputs (sizes, sums of a strided sample), compared over
  the ranks of each data group; identical fingerprints are identical batches, whatever made them.

Both ride on one all-gather of a fixed row of numbers per rank. A prepared loader in the middle
of a pass on any rank silences both (its batches are split by construction). Rank 0 warns, once,
at the user's ``model(x)`` line, with the fix. Sync point: all ranks, at the first training
forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from ..data import Loader, ShardedIterable
from .agree import data_groups, gather_rows, gathers
from .guards import user_frame, warn_at_user
from .loader import DeviceLoader

TENSORS = 8
"""Input tensors fingerprinted (the first ones found in the arguments)."""
SAMPLE = 1024
"""Elements of each tensor summed, evenly strided."""
ROW = 2 + 3 * TENSORS


def watch(rt: Any, model: nn.Module) -> None:
    """Check the first training forward of ``model`` (see the module docstring)."""
    if not gathers(rt) or max(map(len, data_groups(rt))) < 2:
        return  # one process, or no two ranks that should read different data
    handle = None

    def first_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        handle.remove()
        check(rt, (args, kwargs))

    handle = model.register_forward_pre_hook(first_forward, with_kwargs=True)


def check(rt: Any, inputs: Any) -> None:
    """Gather this rank's view of its first batch; rank 0 warns if the ranks read the same
    data. Sync point: all ranks."""
    frame, _ = user_frame(1)
    split, unsplit = _frame_loaders(frame)
    split = split or any(getattr(dl, "in_pass", False) for dl in rt.loop.loaders)
    row = [float(split), float(unsplit is not None), *fingerprint(inputs)]
    rows = gather_rows(rt, row, label="first training step: batch fingerprints")
    if rt.rank != 0 or any(r[0] for r in rows):
        return
    message = _message(rt, rows, unsplit)
    if message is not None:
        warn_at_user(message)


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def fingerprint(inputs: Any) -> list[float]:
    """Per input tensor (up to ``TENSORS``): its size, the sum of a strided sample of
    ``SAMPLE`` elements, and that sum weighted by position (so a reordering shows)."""
    values: list[float] = []
    for t in list(_tensors(inputs))[:TENSORS]:
        flat = t.detach().reshape(-1)
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].to(torch.float64)
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
        values += [float(flat.numel()), *torch.stack([sample.sum(), sample @ weights]).tolist()]
    return values + [0.0] * (ROW - 2 - len(values))


def _kind(value: Any) -> str | None:
    """'split': reads this rank's share; 'unsplit': every rank reads all of it; None: unknown."""
    if isinstance(value, Loader | DeviceLoader):
        return "split"
    if not isinstance(value, DataLoader):
        return None
    if isinstance(value.dataset, ShardedIterable):
        return "split"
    if isinstance(value.dataset, IterableDataset):
        return None  # it may shard itself: the fingerprints decide
    sampler = getattr(value.batch_sampler, "sampler", value.sampler)
    if getattr(sampler, "num_replicas", 1) > 1:
        return "split"
    return "unsplit"


def _frame_loaders(frame: FrameType | None) -> tuple[bool, str | None]:
    """Whether the user's frame holds a loader that splits the data, and the name of one that
    does not (``loader``, ``self.train_loader``)."""
    if frame is None:
        return False, None
    named = list(frame.f_locals.items())
    owner = frame.f_locals.get("self")
    if owner is not None and not isinstance(owner, nn.Module) and hasattr(owner, "__dict__"):
        named += [(f"self.{k}", v) for k, v in vars(owner).items()]
    split, unsplit = False, None
    for name, value in named[:4096]:
        kind = _kind(value)
        split = split or kind == "split"
        if kind == "unsplit" and unsplit is None:
            unsplit = f"`{name}` (DataLoader over {_size(value.dataset)} with "
            unsplit += f"{type(getattr(value.batch_sampler, 'sampler', value.sampler)).__name__})"
    return split, unsplit


def _size(dataset: Any) -> str:
    try:
        return f"{len(dataset)} samples"
    except TypeError:
        return type(dataset).__name__


def _same(a: list[float], b: list[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


def _identical(rt: Any, rows: list[list[float]]) -> list[int]:
    """The first set of ranks of one data group whose first batches are identical."""
    for group in data_groups(rt):
        for i, r in enumerate(group):
            if rows[r][2] <= 0:  # no input tensor: nothing to compare
                continue
            same = [q for q in group[i:] if _same(rows[r][2:], rows[q][2:])]
            if len(same) > 1:
                return same
    return []


def _message(rt: Any, rows: list[list[float]], unsplit: str | None) -> str | None:
    world = len(rows)
    same = _identical(rt, rows)
    if all(r[1] for r in rows) and unsplit is not None:
        what = f"the loader {unsplit} in this loop has no distributed sampler"
    elif same:
        listed = ", ".join(map(str, same[:-1])) + f" and {same[-1]}"
        what = f"ranks {listed} trained their first step on identical batches"
    else:
        return None
    return (
        f"rankwise: {what} (strategy={rt.strategy!r}, {world} processes): each process reads "
        f"the whole data set, so an epoch costs {world} times the work, and a step's global "
        f"batch holds samples that {world} processes drew from the same data instead of "
        f"{world} different shares of it. The loader was not split by rt.prepare. "
        "Fix: model, opt, loader = rt.prepare(model, opt, loader) (or, the model being "
        "prepared already, loader = rt.prepare_loader(loader)), or build it with "
        "rw.loader(dataset, batch_size=...); a DistributedSampler of your own or an "
        "rw.ShardedIterable data set splits it too."
    )
