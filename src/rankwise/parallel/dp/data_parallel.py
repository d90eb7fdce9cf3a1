"""DataParallel: one process, one thread per device, the whole algorithm in four calls.

    scatter -> replicate -> parallel_apply -> gather

The master copy of the model lives on ``device_ids[0]``. Every forward splits the batch over
the devices, copies the parameters to them (autograd-linked, so ``backward`` sums every
replica's gradient into the master's ``.grad``), runs the replicas in threads and concatenates
their outputs on ``output_device``. The optimizer updates the master copy only.

Balanced mode (``loss_fn=``) runs the loss on each replica too, and gathers only one scalar per
replica instead of every output, so the output device no longer holds the whole batch's outputs
(and the loss's activations over them): the well-known "the master device uses more memory" (docs/dp.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...checkpoint.state_dict import add_module_prefix, strip_module_prefix
from ...errors import ConfigError
from ...job.devices import DeviceLike, accelerator, resolve_device
from ...validate import choice, fail, shown
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter_with_sizes

_REDUCTIONS = ("mean", "sum", "none")


def resolve_device_ids(
    device_ids: Sequence[DeviceLike] | None, module: nn.Module
) -> list[torch.device]:
    """``device_ids`` as devices; ``None`` means every accelerator, or else the module's device."""
    if device_ids is None:
        acc = accelerator()
        if acc is not None:
            return [torch.device(acc.type, i) for i in range(torch.accelerator.device_count())]
        first = next(itertools.chain(module.parameters(), module.buffers()), None)
        return [torch.device("cpu") if first is None else resolve_device(first.device, "device")]
    if isinstance(device_ids, (str, int, torch.device)):
        raise ConfigError(
            f"device_ids={device_ids!r} must be a list of devices",
            fix=f"device_ids=[{device_ids!r}]",
        )
    devices = [resolve_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
    if not devices:
        raise ConfigError(
            "device_ids=[] lists no device", fix="pass e.g. device_ids=[0, 1] or ['cpu', 'cpu']"
        )
    return devices


def _check_loss_arguments(loss_fn: Any, loss_reduction: Any) -> None:
    """By type, before anything is built: a ``loss_reduction`` without ``loss_fn`` too."""
    if loss_fn is not None and not callable(loss_fn):
        fail("loss_fn", loss_fn, "a function (output, target) -> loss, or None",
             where="DataParallel()", fix="pass e.g. loss_fn=nn.CrossEntropyLoss().")  # fmt: skip
    choice("loss_reduction", loss_reduction, _REDUCTIONS, optional=True, where="DataParallel()")


def _loss_reduction(loss_fn: Callable[..., Any], given: str | None) -> str:
    reduction = given if given is not None else getattr(loss_fn, "reduction", "mean")
    if reduction not in _REDUCTIONS:
        raise ConfigError(
            f"loss_reduction={reduction!r} is not one of {_REDUCTIONS}",
            fix="say how loss_fn reduces a batch: 'mean' over samples, 'sum', or 'none'",
        )
    return reduction


class _LossStep(nn.Module):
    """``loss_fn(module(*inputs), target)``: what each replica runs in balanced mode."""

    def __init__(self, module: nn.Module, loss_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn  # a child when it is a Module (class weights get replicated)

    def forward(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        has_target = "target" in kwargs
        target = kwargs.pop("target", None)
        output = self.module(*inputs, **kwargs)
        return self.loss_fn(output, target) if has_target else self.loss_fn(output)


class DataParallel(nn.Module):
    """Data parallelism in one process: the batch is split over ``device_ids``, one thread each.

    Batch size: the batch you pass (your DataLoader's ``batch_size``) is the GLOBAL batch. It is
    split along ``dim`` over the devices: ``batch_size=30`` on 2 devices runs 15 samples per
    device, 30 per step in total (with DDP, each process loads its own batch: 30 per device, 60
    in total). Chunks differ by at most one sample (10 on 4 devices: 3, 3, 2, 2); a batch smaller
    than the number of devices uses fewer devices. Tensors nested in tuples, lists, dicts,
    namedtuples and dataclasses are split; other arguments reach every replica unchanged.

    Devices: ``device_ids`` are ints (accelerator indices, as torch), strings or ``torch.device``.
    The module must already be on ``device_ids[0]`` (the master, which the optimizer updates);
    outputs land on ``output_device`` (default ``device_ids[0]``; ``-1`` is the CPU).
    ``device_ids=["cpu", "cpu"]`` gives two CPU replicas: two threads on the one CPU device,
    whose parameters are views of the master's (no copy), useful for multi-core CPU training
    and for testing. Any replica on the master's device shares its parameters this way.

    Balanced mode: with ``loss_fn``, call ``loss = dp(x, target=y)``; each replica computes
    ``loss_fn(module(x_i), y_i)`` and only the per-replica losses are gathered, combined so the
    gradients equal the standard mode's (``loss_reduction`` "mean": weighted by each replica's
    share of the batch; "sum": added; "none": per-sample losses concatenated). The reduction is
    read from ``loss_fn.reduction`` when it has one, else "mean" is assumed: pass
    ``loss_reduction`` for a function that reduces differently. "mean" means the mean over
    samples along ``dim``; for losses averaged over something else (ignored tokens, class
    weights), use a summed loss and divide by your own count.

    State: ``state_dict()`` is the wrapped module's (no ``module.`` prefix);
    ``load_state_dict`` accepts keys with or without the prefix.

    There are no inter-process sync points: DataParallel is one process; the replica threads
    meet in ``gather`` at the end of every forward.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        loss_fn: Callable[..., Any] | None = None,
        loss_reduction: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(
                f"DataParallel(module={shown(module)}) got a {type(module).__name__}, not a "
                "torch.nn.Module",
                fix="pass the model itself: DataParallel(model, device_ids=...)",
            )
        _check_loss_arguments(loss_fn, loss_reduction)
        self.module = module
        self.device_ids = resolve_device_ids(device_ids, module)
        self.output_device = (
            self.device_ids[0]
            if output_device is None
            else resolve_device(output_device, "output_device")
        )
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ConfigError(f"dim={dim!r} must be an int", fix="dim=0 splits the first dimension")
        self.dim = dim
        self.loss_fn = None
        self.loss_reduction = None
        if loss_fn is not None:
            self.loss_reduction = _loss_reduction(loss_fn, loss_reduction)
            # Kept out of the module tree so state_dict stays the model's alone.
            object.__setattr__(self, "loss_fn", loss_fn)
        self._check_master()
        # No `module.` in saved keys; loading accepts keys with or without it (docs/pitfalls.md#pitfall-5).
        self.register_state_dict_post_hook(strip_module_prefix)
        self.register_load_state_dict_pre_hook(add_module_prefix)

    def _check_master(self) -> None:
        master = self.device_ids[0]
        named = itertools.chain(self.module.named_parameters(), self.module.named_buffers())
        for name, t in named:
            if t.device != master:
                raise ConfigError(
                    f"DataParallel: the model's tensor `{name}` is on {t.device}, but "
                    f"device_ids[0] is {master}; the master copy must be on the first device",
                    fix=f"call model.to('{master}') before wrapping (or list {t.device} first "
                    "in device_ids)",
                )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Split, replicate, run, gather. In balanced mode, returns the combined scalar loss."""
        self._check_master()
        balanced = self.loss_fn is not None  # standard mode passes `target=` on to the model
        args, kws, sizes = scatter_with_sizes(inputs, kwargs, self.device_ids, self.dim)
        devices = self.device_ids[: len(args)]
        root = _LossStep(self.module, self.loss_fn) if balanced else self.module
        if len(devices) == 1:
            outputs = [root(*args[0], **kws[0])]  # one chunk: no copy, no thread
        else:
            outputs = parallel_apply(replicate(root, devices), args, kws, devices)
        if balanced:
            return self._combine_losses(outputs, sizes)
        return gather(outputs, self.output_device, self.dim)

    def _combine_losses(self, losses: list[Any], sizes: list[int] | None) -> torch.Tensor:
        """The batch loss from per-replica losses, with the standard mode's gradients."""
        for i, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or (self.loss_reduction != "none" and loss.dim()):
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ConfigError(
                    f"DataParallel: loss_fn returned {got} on replica {i} with "
                    f"loss_reduction={self.loss_reduction!r}; expected a 0-dim tensor",
                    fix="make loss_fn reduce to a scalar, or pass loss_reduction='none' for "
                    "per-sample losses",
                )
        if self.loss_reduction == "none":
            return gather(losses, self.output_device, self.dim)
        if len(losses) == 1:
            return losses[0].to(self.output_device)
        moved = [loss.to(self.output_device) for loss in losses]
        if self.loss_reduction == "sum" or sizes is None:
            return torch.stack(moved).sum()
        # mean over N samples = sum_i n_i * mean_i / N: every sample's gradient is scaled by 1/N
        # exactly as in one loss over the gathered batch, also for uneven chunks.
        return torch.stack([m * n for m, n in zip(moved, sizes, strict=True)]).sum() / sum(sizes)
