"""What the replicas of a DistributedDataParallel module agree on, and how they agree.

- which parameters are averaged (trainable, each shared tensor once),
- that every rank built the same model (names, shapes, dtypes compared before any broadcast),
- rank 0's values, broadcast in a few large messages instead of one per tensor,
- state_dict keys without the ``module.`` prefix (loading accepts both spellings).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import wire
from ..diagnose import fingerprints
from ..errors import DistributedError, ModelError
from .dp.scatter_gather import to_device

_BROADCAST_CHUNK_BYTES = 256 * 1024 * 1024
"""Largest single broadcast at construction: bounds the temporary copy of the model."""


def trainable_parameters(module: nn.Module, rank: int) -> tuple[list[str], list[nn.Parameter]]:
    """(names, parameters) that get averaged: requires_grad, shared ones once, in module order."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ModelError(
            f"the module ({type(module).__name__}) has no parameter with requires_grad=True, so "
            "DistributedDataParallel has nothing to average",
            fix="wrap the model you train; for evaluation only, use the bare module.",
            rank=rank,
        )
    return [n for n, _ in named], [p for _, p in named]


def frozen_at_wrap(
    module: nn.Module, trainable: Sequence[nn.Parameter], ignore: frozenset[str] = frozenset()
) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``module`` outside ``trainable`` (frozen when the engine was built):
    the engine keeps no bucket or shard for them, so one unfrozen later must be refused."""
    kept = {id(p) for p in trainable}
    return [(n, p) for n, p in module.named_parameters() if id(p) not in kept and n not in ignore]


def check_unfrozen(frozen: Sequence[tuple[str, nn.Parameter]], engine: str, rank: int) -> None:
    """A ``ModelError`` naming every parameter of ``frozen`` that requires grad now (only
    while grad mode is on: an evaluation builds no gradient)."""
    if not torch.is_grad_enabled() or not any(p.requires_grad for _, p in frozen):
        return  # the per-step cost: one flag per frozen parameter
    now = [n for n, p in frozen if p.requires_grad]
    shown = ", ".join(now[:8]) + (f" ... and {len(now) - 8} more" if len(now) > 8 else "")
    raise ModelError(
        f"{len(now)} parameter(s) had requires_grad=False when {engine} was built and "
        f"require grad now: {shown}. The engine keeps nothing for them: their gradients would "
        "never be averaged (or, sharded, never reach the optimizer)",
        fix="set requires_grad before wrapping (rt.prepare / the engine), or wrap the model "
        "again after unfreezing; to train in stages, unfreeze every stage's layers up front "
        "and keep the ones that wait out of the optimizer (or at learning rate 0).",
        rank=rank,
    )


def _signature(module: nn.Module) -> list[list]:
    """[kind, name, shape, dtype, requires_grad] per parameter and buffer: JSON, as it travels."""
    sig = [
        ["parameter", n, list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad]
        for n, p in module.named_parameters()
    ]
    sig += [
        ["buffer", n, list(b.shape), str(b.dtype).replace("torch.", ""), False]
        for n, b in module.named_buffers()
    ]
    return sig


def _describe(entry: list | None) -> str:
    if entry is None:
        return "nothing"
    if not (isinstance(entry, list) and len(entry) == 5):
        return f"a malformed entry {str(entry)[:80]!r}"
    kind, name, shape, dtype, grad = entry
    frozen = "" if kind == "buffer" or grad else ", frozen"
    return f"{kind} {name!r} of shape {shape} {dtype}{frozen}"


def verify_same_model(module: nn.Module, group: dist.ProcessGroup | None, rank: int) -> None:
    """Refuse to continue unless every rank holds the same parameter and buffer layout.

    Every rank receives every rank's signature, so all ranks raise the same error together
    (no rank is left waiting in a later collective). Signatures travel as JSON, never pickled:
    a peer cannot run code here. Sync point: all ranks.
    """
    world = dist.get_world_size(group)
    gathered = wire.all_gather_json(_signature(module), label="model signature", group=group)
    reference = gathered[0]
    for other in range(1, world):
        theirs = gathered[other]
        if theirs == reference:
            continue
        if not isinstance(theirs, list) or not isinstance(reference, list):
            theirs = theirs if isinstance(theirs, list) else [theirs]
            reference = reference if isinstance(reference, list) else [reference]
        k = next(
            (i for i, (a, b) in enumerate(zip(reference, theirs, strict=False)) if a != b),
            min(len(reference), len(theirs)),
        )
        mine = reference[k] if k < len(reference) else None
        them = theirs[k] if k < len(theirs) else None
        who = wire.global_rank(group, other)
        raise DistributedError(
            f"the model differs across ranks: entry {k} is {_describe(mine)} on rank 0 but "
            f"{_describe(them)} on rank {who} (rank 0 has {len(reference)} parameters and "
            f"buffers, rank {who} has {len(theirs)})",
            fix="build the same model, with the same arguments and frozen layers, on every "
            "rank before wrapping; rank 0's weights are then copied to all ranks.",
            rank=rank,
        )


def _chunks(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors by device into runs of at most _BROADCAST_CHUNK_BYTES.

    Within a run, wider dtypes come first, so that every tensor starts at a byte offset that is
    a multiple of its element size when the run travels as one byte buffer.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in sorted(tensors, key=lambda t: -t.element_size()):
        by_device[t.device].append(t)
    out: list[list[torch.Tensor]] = []
    for group in by_device.values():
        run: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if run and size + nbytes > _BROADCAST_CHUNK_BYTES:
                out.append(run)
                run, size = [], 0
            run.append(t)
            size += nbytes
        out.append(run)
    return out


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, src: int = 0
) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values: one byte message per device (256 MB).

    Mixed dtypes (BatchNorm's float statistics and int64 counters) share one message, so a
    forward pays for one broadcast, not one per dtype. Sync point: all ranks.
    """
    if not tensors:
        return
    root = dist.get_rank(group) == src
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
    with torch.no_grad():
        for run in _chunks(tensors):
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in run])
            entry = fingerprints.record(
                "broadcast",
                flat,
                label=f"rank {src}'s parameters/buffers",
                group=group,
                extra=f"src={src}",
            )
            entry.watch(dist.broadcast(flat, group=group, group_src=src, async_op=True))
            pending.append((entry, flat, run))
            if len(pending) > 1:  # two messages in flight: at most two chunks copied at once
                _unpack(*pending.pop(0), root)
        for item in pending:
            _unpack(*item, root)


def _unpack(entry: Any, flat: torch.Tensor, run: list[torch.Tensor], root: bool) -> None:
    entry.wait()  # a failure raises the diagnosis naming every rank's last collective
    if not root:
        offset = 0
        for t in run:
            n = t.numel() * t.element_size()
            t.copy_(flat[offset : offset + n].view(t.dtype).view(t.shape))
            offset += n


def move_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside it on ``device``, containers' types kept.

    The one walker (``scatter_gather.tree_map``): tuples, lists, dicts, namedtuples and
    dataclasses keep their type, as in torch's DistributedDataParallel.
    """
    return to_device(obj, device)
