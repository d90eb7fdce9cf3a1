"""Scatter a batch over devices and gather the replicas' outputs back: DataParallel's two ends.

``scatter`` walks the arguments (tensors nested in tuples, lists, dicts, namedtuples and
dataclasses), splits every tensor into per-device chunks along ``dim`` and moves chunk ``i`` to
device ``i``; everything that is not a tensor is handed to every replica as it is. ``gather`` is
the inverse: the replicas' outputs, with the same nesting, concatenated on one device.

Both are differentiable: the chunks are autograd views of the input and the gathered output is
an autograd ``cat`` of copies, so gradients flow from the gathered output back to each replica
and from each chunk back to the input.

Chunk sizes are balanced (they differ by at most one: 10 rows on 4 devices is 3, 3, 2, 2), so a
batch uses every device as long as it has at least one row per device; a smaller batch uses
fewer devices, and the callers run only that many replicas.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ...errors import ConfigError

Device = torch.device | str | int


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]] | None:
    """The (path, child) pairs of a container we scatter into, or None for a leaf."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, dict):
        return ((f"{path}[{k!r}]", v) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return ((f"{path}.{k}", v) for k, v in zip(obj._fields, obj, strict=True))
    if isinstance(obj, (list, tuple)):
        return ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ((f"{path}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return None


def _rebuild(obj: Any, values: list[Any]) -> Any:
    """A container of ``obj``'s type and shape holding ``values`` (in ``_children`` order)."""
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict / defaultdict and their extras
        for key, value in zip(obj.keys(), values, strict=True):
            out[key] = value
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*values)
    if isinstance(obj, tuple):
        return type(obj)(values)
    if isinstance(obj, list):
        out = copy.copy(obj)
        out[:] = values
        return out
    out = copy.copy(obj)  # a dataclass; frozen ones too, hence object.__setattr__
    for f, value in zip(dataclasses.fields(obj), values, strict=True):
        object.__setattr__(out, f.name, value)
    return out


def tree_map(fn: Callable[[str, torch.Tensor], Any], obj: Any, path: str = "input") -> Any:
    """Apply ``fn(path, tensor)`` to every tensor in ``obj``, keeping the nesting and leaves."""
    children = _children(obj, path)
    if children is None:
        return fn(path, obj) if isinstance(obj, torch.Tensor) else obj
    return _rebuild(obj, [tree_map(fn, child, p) for p, child in children])


def non_blocking(device: torch.device) -> bool:
    """The one rule for ``non_blocking`` copies: only towards an accelerator.

    Copies to an accelerator are stream-ordered, so they may be asynchronous (from pinned host
    memory they overlap compute; from pageable memory they are synchronous anyway). A copy to
    the CPU must be synchronous, or the host could read the tensor before it has arrived.
    """
    return device.type != "cpu"


def to_device(obj: Any, device: Device) -> Any:
    """``obj`` with every tensor inside it moved to ``device``; nesting and types kept."""
    dev = torch.device(device)
    asynchronous = non_blocking(dev)
    return tree_map(lambda _p, t: t.to(dev, non_blocking=asynchronous), obj)


def tensors(obj: Any, path: str = "input") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` with its path (e.g. ``args[0]['mask']``), in traversal order."""
    found: list[tuple[str, torch.Tensor]] = []
    tree_map(lambda p, t: found.append((p, t)), obj, path)
    return found


def chunk_sizes(batch: int, n_devices: int) -> list[int]:
    """Balanced chunk sizes for ``batch`` rows on at most ``n_devices`` devices (no empty chunk)."""
    n = min(batch, n_devices)
    return [batch // n + (1 if i < batch % n else 0) for i in range(n)]


def _batch_size(leaves: list[tuple[str, torch.Tensor]], dim: int) -> int | None:
    """The common size along ``dim`` of every tensor that has a batch dimension, checked."""
    batched = [(p, t) for p, t in leaves if t.dim() > 0]
    if not batched:
        return None
    ref_path, ref = batched[0]
    if not -ref.dim() <= dim < ref.dim():
        raise ConfigError(
            f"scatter: `{ref_path}` has shape {tuple(ref.shape)}, which has no dim={dim} "
            "to split the batch along",
            fix="pass dim= naming the batch dimension of your inputs (DataParallel(..., dim=0))",
        )
    size = ref.shape[dim]
    for path, t in batched[1:]:
        has_dim = -t.dim() <= dim < t.dim()
        if not has_dim or t.shape[dim] != size:
            got = f"size {t.shape[dim]}" if has_dim else f"shape {tuple(t.shape)}"
            raise ConfigError(
                f"scatter: `{path}` has {got} along dim {dim}, but `{ref_path}` has {size}; "
                "every tensor argument is split into per-device chunks of the batch, so all "
                "must have the same batch size",
                fix="give every per-sample tensor the same batch size; pass a per-batch "
                "constant as a Python value or a 0-dim tensor (those are copied, not split)",
            )
    if size == 0:
        raise ConfigError(
            f"scatter: `{ref_path}` is an empty batch (shape {tuple(ref.shape)}, size 0 along "
            f"dim {dim}); there is nothing to split over the devices",
            fix="skip empty batches before calling the model (or DataLoader(drop_last=True) "
            "when the data set size is the cause)",
        )
    return size


def scatter(
    inputs: tuple, kwargs: dict[str, Any] | None, devices: Sequence[Device], dim: int = 0
) -> tuple[list[tuple], list[dict[str, Any]]]:
    """Split positional and keyword arguments into one ``(args, kwargs)`` pair per device used.

    Every tensor with a batch dimension is split along ``dim`` into balanced chunks, chunk ``i``
    moved to ``devices[i]``; 0-dim tensors are copied to every device; other values are passed
    to every replica as they are (the same object: replicas are threads of one process).
    Returns as many pairs as devices used: ``min(batch, len(devices))``, or one when no
    argument is a batched tensor. Raises ``ConfigError`` naming the argument for an empty batch
    or for tensors whose batch sizes differ.
    """
    args, kws, _ = scatter_with_sizes(inputs, kwargs, devices, dim)
    return args, kws


def scatter_with_sizes(
    inputs: tuple, kwargs: dict[str, Any] | None, devices: Sequence[Device], dim: int = 0
) -> tuple[list[tuple], list[dict[str, Any]], list[int] | None]:
    """``scatter``, plus the chunk sizes (``None`` when no argument is a batched tensor)."""
    kwargs = kwargs or {}
    devs = [torch.device(d) for d in devices]
    if not devs:
        raise ConfigError("scatter: devices is empty", fix="pass at least one device")
    leaves = tensors(tuple(inputs), "args") + tensors(kwargs, "kwargs")
    batch = _batch_size(leaves, dim)
    sizes = None if batch is None else chunk_sizes(batch, len(devs))
    n = 1 if sizes is None else len(sizes)
    # One split per tensor, shared by all devices (id() is stable: the inputs outlive this call).
    pieces: dict[int, list[torch.Tensor]] = {}
    for _, t in leaves:
        if id(t) not in pieces:
            parts = t.split(sizes, dim) if t.dim() > 0 and sizes else [t] * n
            pieces[id(t)] = [_move(p, devs[i]) for i, p in enumerate(parts)]
    per_args = [tree_map(lambda _p, t, i=i: pieces[id(t)][i], tuple(inputs)) for i in range(n)]
    per_kwargs = [tree_map(lambda _p, t, i=i: pieces[id(t)][i], kwargs) for i in range(n)]
    return per_args, per_kwargs, sizes


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=non_blocking(device))


def gather(outputs: Sequence[Any], output_device: Device, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs on ``output_device``, keeping their nesting.

    Tensors are concatenated along ``dim`` (differentiably); 0-dim tensors (one scalar per
    replica, e.g. a loss) are stacked into a vector with one value per replica; ``None`` stays
    ``None``; any other value becomes the list of the replicas' values.
    """
    if not outputs:
        raise ConfigError("gather: no outputs to gather", fix="pass one output per replica")
    device = torch.device(output_device)
    return _gather(list(outputs), device, dim, "output")


def _same_shape(a: Any, b: Any) -> bool:
    """Whether two replicas' containers have the same type and the same keys or length."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b)
    return True


def _gather(outs: list[Any], device: torch.device, dim: int, path: str) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise ConfigError(f"gather: `{path}` is a tensor on some replicas but not on others")
        moved = [o.to(device) for o in outs]
        if first.dim() == 0:
            return torch.stack(moved)
        return moved[0] if len(moved) == 1 else torch.cat(moved, dim)  # cat of one would copy
    if first is None:
        return None
    children = _children(first, path)
    if children is None:
        return [o for o in outs]
    paths = [p for p, _ in children]
    per_replica = [[c for _, c in _children(o, path) or ()] for o in outs]
    if any(not _same_shape(first, o) for o in outs[1:]):
        raise ConfigError(
            f"gather: `{path}` has a different structure on different replicas "
            f"({[type(o).__name__ for o in outs]})",
            fix="return the same nesting of outputs from every call of the model's forward",
        )
    values = [_gather([c[k] for c in per_replica], device, dim, p) for k, p in enumerate(paths)]
    return _rebuild(first, values)
