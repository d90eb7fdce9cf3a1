"""Copy a module onto devices, keeping every replica's parameters linked to the master's by autograd.

A replica is a shallow copy of each submodule whose parameters are replaced by plain (non-leaf)
tensors computed *from* the master parameters: a copy on another device, or a view of the
master tensor when the replica sits on the master's own device (CPU replicas, or two replicas
sharing one GPU). Because each is an autograd function of the master parameter, a single
``loss.backward()`` through any number of replicas accumulates all their gradients into the
master's ``.grad`` — which is how DataParallel sums gradients without a reduction step.

The copy is made again on every forward (DataParallel's documented cost: parameters travel
every step, where DDP broadcasts them once). Copies to another device are coalesced per dtype:
one flat transfer per device instead of one per parameter.

Buffers (BatchNorm's running statistics, ...) are copied without autograd. The first replica on
the buffer's own device uses the master buffer itself, so its in-place updates persist, as in
torch's DataParallel; other replicas get copies whose updates are discarded after the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn

from ...errors import ConfigError
from .scatter_gather import non_blocking

M = TypeVar("M", bound=nn.Module)


def copy_coalesced(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of ``tensors`` on ``device``, differentiable, with one transfer per (device, dtype).

    The tensors are flattened into one buffer per source device and dtype, the buffer is moved
    in one copy, and each result is a view of the moved buffer; gradients flow back through the
    same path (one transfer back per buffer).
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for indices in groups.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        moved = flat.to(device, non_blocking=non_blocking(device))
        sizes = [tensors[i].numel() for i in indices]
        for i, part in zip(indices, moved.split(sizes), strict=True):
            out[i] = part.view(tensors[i].shape)
    return out  # type: ignore[return-value]


def broadcast(
    tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]
) -> list[list[torch.Tensor]]:
    """One autograd-linked version of ``tensors`` per device: ``result[j][i]`` is on ``devices[j]``.

    A tensor already on ``devices[j]`` is aliased by a view (no copy, same storage, gradient
    flows to the original); the others are copied with ``copy_coalesced``.
    """
    result = []
    for device in devices:
        local: list[torch.Tensor | None] = [
            t.view_as(t) if t.device == device else None for t in tensors
        ]
        remote = [i for i, t in enumerate(tensors) if t.device != device]
        copies = copy_coalesced([tensors[i] for i in remote], device) if remote else []
        for i, c in zip(remote, copies, strict=True):
            local[i] = c
        result.append(local)
    return result  # type: ignore[return-value]


def _broadcast_buffers(
    buffers: Sequence[torch.Tensor], devices: Sequence[torch.device]
) -> list[list[torch.Tensor]]:
    """Detached buffer copies per device; the first replica on a buffer's device gets the buffer."""
    result: list[list[torch.Tensor]] = [[] for _ in devices]
    for buf in buffers:
        claimed = False
        for j, device in enumerate(devices):
            if device == buf.device and not claimed:
                claimed = True  # this replica's in-place updates (running stats) reach the master
                result[j].append(buf)
            elif device == buf.device:
                result[j].append(buf.detach().clone())  # another thread would race on the original
            else:
                result[j].append(buf.detach().to(device, non_blocking=non_blocking(device)))
    return result


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A module object sharing everything with ``module`` except its parameter/buffer/child maps."""
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    replica._parameters = {}
    replica._buffers = module._buffers.copy()
    replica._modules = module._modules.copy()
    return replica


def replicate(module: M, devices: Sequence[torch.device | str]) -> list[M]:
    """Replicas of ``module``, one per device, whose parameters are autograd functions of its own.

    Tied parameters stay tied (a parameter shared by two submodules maps to one copy), and so do
    shared submodules. A replica's ``forward`` may run in any thread; its ``parameters()`` is
    empty (its tensors are not leaves), so optimizers must be built on the master module.
    """
    if isinstance(module, torch.jit.ScriptModule):
        raise ConfigError(
            f"replicate: {type(module).__name__} is a TorchScript module, which cannot be "
            "copied submodule by submodule",
            fix="wrap the eager (non-scripted) module",
        )
    module = _uncompiled(module)
    devs = [torch.device(d) for d in devices]
    buffers = list(module.buffers())
    # Parameters (deduplicated: tied weights appear once) and buffers that require grad keep
    # their autograd link; other buffers are plain copies.
    linked = list(module.parameters()) + [b for b in buffers if b.requires_grad]
    plain = [b for b in buffers if not b.requires_grad]
    linked_copies = broadcast(linked, devs)
    plain_copies = _broadcast_buffers(plain, devs)
    return [
        _build(module, {id(t): c for t, c in zip(linked + plain, lc + pc, strict=True)})
        for lc, pc in zip(linked_copies, plain_copies, strict=True)
    ]


def _uncompiled(module: M) -> M:
    """The module under ``torch.compile``'s wrapper: what the replicas copy.

    The wrapper's ``forward`` is bound to the original module object, so a shallow copy of
    it would run the master's submodules and parameters, not the replica's (on another GPU:
    the wrong device). Replicas are rebuilt every step, so compiling each again would retrace
    every step: they run eagerly instead, and the docs say so (docs/training.md).
    """
    inner = module._modules.get("_orig_mod")
    if isinstance(inner, nn.Module) and hasattr(module, "dynamo_ctx"):
        return _uncompiled(inner)  # type: ignore[return-value]
    return module


def _build(root: M, copy_of: dict[int, torch.Tensor]) -> M:
    """One replica of ``root``: every submodule shallow-copied, every tensor from ``copy_of``."""
    modules = list(root.modules())  # deduplicated: a shared submodule appears once
    copies = {id(m): _shallow_copy(m) for m in modules}
    for m in modules:
        r = copies[id(m)]
        for key, child in m._modules.items():
            r._modules[key] = None if child is None else copies[id(child)]
        for key, p in m._parameters.items():
            if p is None:
                r._parameters[key] = None
            else:
                setattr(r, key, copy_of[id(p)])  # not a leaf: a plain attribute, not a Parameter
        for key, b in m._buffers.items():
            if b is not None:
                r._buffers[key] = copy_of[id(b)]
    return copies[id(root)]  # type: ignore[return-value]
