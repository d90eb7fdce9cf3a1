"""``rw.SyncBatchNorm``: batch normalisation over the global batch, on CPU (Gloo) and CUDA.

With small per-rank batches, each rank's BatchNorm normalises with its own few samples: the
statistics are noisy and the model trained is not the one-process model on the global batch.
torch's ``nn.SyncBatchNorm`` fixes that on CUDA only (it refuses CPU tensors). Ours is the
same mathematics with our collectives, so it runs wherever the process group does:

- forward (training): every rank's (count, mean, sum of squared deviations) per channel is
  gathered in one collective and combined exactly (Chan's parallel form, in float64: no
  ``sum(x^2) - sum(x)^2`` cancellation); ranks may hold different numbers of samples, even
  none;
- backward: the two per-channel sums the input gradient needs (of ``dy`` and of
  ``dy * x_hat``) are all-reduced once; the weight and bias gradients stay local, as a data
  parallel engine then averages them like any other gradient;
- running statistics follow torch's rule (momentum or a cumulative average, the unbiased
  variance of the global batch), and eval mode uses them without communicating.

``convert_sync_batchnorm(model)`` swaps every ``BatchNorm1d/2d/3d`` for one, keeping its
parameters (the same tensors: an optimizer built before still holds them) and buffers.
Sync point (training forward and backward): the ranks of the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import runtime
from ..comm import collectives as comm
from ..errors import ConfigError


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``x`` (N, C, ...)."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def global_stats(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean and biased variance per channel over every rank's ``x``, and the global count.

    One all-gather of [count, mean, M2] per rank, combined in float64. Sync point: ``group``.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    local = torch.zeros(1 + 2 * channels, dtype=torch.float64, device=x.device)
    if count:
        xd = x.detach().to(torch.float64)
        mean = xd.mean(_channel_dims(x))
        local[0] = count
        local[1 : 1 + channels] = mean
        local[1 + channels :] = (xd - _view(mean, x)).pow(2).sum(_channel_dims(x))
    slots = comm.all_gather_tensors(local.to(comm._comm_device()), group=group,
                                    label="SyncBatchNorm stats")  # fmt: skip
    every = torch.stack(slots).to(x.device)
    counts = every[:, :1]
    total = float(counts.sum())
    if total < 2:
        raise ConfigError(
            f"SyncBatchNorm got {int(total)} value(s) per channel over all ranks (input shape "
            f"{tuple(x.shape)} on this rank); the batch statistics need at least 2",
            fix="use a larger batch, or put the model in eval mode (model.eval()) for single samples.",
        )
    means, m2 = every[:, 1 : 1 + channels], every[:, 1 + channels :]
    mean = (counts * means).sum(0) / total
    var = (m2 + counts * (means - mean).pow(2)).sum(0) / total
    return mean, var, int(total)


class _Normalise(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with the global batch's mean and invstd."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, mean, invstd, total: int, group: Any):
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        x_hat = (x.to(compute) - _view(mean.to(compute), x)) * _view(invstd.to(compute), x)
        y = x_hat
        if weight is not None:
            y = y * _view(weight.to(compute), x)
        if bias is not None:
            y = y + _view(bias.to(compute), x)
        ctx.save_for_backward(x_hat, invstd.to(compute), weight)
        ctx.total, ctx.group, ctx.in_dtype = total, group, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x_hat, invstd, weight = ctx.saved_tensors
        dy = dy.to(x_hat.dtype)
        dims = _channel_dims(dy)
        sums = torch.cat([dy.sum(dims), (dy * x_hat).sum(dims)])
        local = sums.clone()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # The input gradient needs the two sums over the global batch.
            everyone = comm.all_reduce_(sums.to(comm._comm_device()), "sum", group=ctx.group,
                                        label="SyncBatchNorm backward").to(dy.device)  # fmt: skip
            c = x_hat.shape[1]
            mean_dy = everyone[:c] / ctx.total
            mean_dy_xhat = everyone[c:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = _view(scale, dy) * (dy - _view(mean_dy, dy) - x_hat * _view(mean_dy_xhat, dy))
            grad_x = grad_x.to(ctx.in_dtype)
        c = x_hat.shape[1]
        if ctx.needs_input_grad[1]:
            grad_w = local[c:].to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = local[:c].to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of every rank in ``process_group`` (default: this
    rank's data group, the world without a mesh); CPU and CUDA. Input (N, C, ...), any N per
    rank. Outside a training forward, or in a single process, it is torch's BatchNorm.
    Sync point (training forward and backward): the ranks of the group."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
    ) -> None:
        more = {} if bias else {"bias": False}  # a BatchNorm without bias: newer torch only
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,
                         **more)  # fmt: skip
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ConfigError(
                f"SyncBatchNorm expects input (N, C, ...) with at least 2 dimensions, got shape "
                f"{tuple(input.shape)}",
                fix="batch the input: x.unsqueeze(0) for one sample.",
            )

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else runtime.data_group()

    def _synced(self) -> bool:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self._group()) > 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self._synced():
            return super().forward(input)
        group = self._group()
        mean, var, total = global_stats(input, group)
        if self.track_running_stats:
            self._update_running(mean, var, total)
        invstd = torch.rsqrt(var + self.eps)
        return _Normalise.apply(input, self.weight, self.bias, mean, invstd, total, group)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, total: int) -> None:
        """torch's rule: momentum (or 1/batches seen when None), the unbiased variance."""
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)  # fmt: skip
        unbiased = var * (total / (total - 1))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """``module`` with every BatchNorm (1d/2d/3d, torch's SyncBatchNorm) replaced by
    ``rw.SyncBatchNorm``, keeping its parameters and buffers (the same tensors) and its
    train/eval mode. Returns the new top module when ``module`` itself is a BatchNorm."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        return _converted(module, process_group)
    for name, child in list(module.named_children()):
        new = convert_sync_batchnorm(child, process_group)
        if new is not child:
            setattr(module, name, new)
    return module


def _converted(bn: _BatchNorm, process_group: Any) -> SyncBatchNorm:
    has_bias = not bn.affine or getattr(bn, "bias", None) is not None
    sync = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                         process_group, device="meta", bias=has_bias)  # fmt: skip
    with torch.no_grad():
        if bn.affine:
            sync.weight, sync.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(sync, name, getattr(bn, name))
    for name, child in bn.named_children():
        sync.add_module(name, child)
    sync.train(bn.training)
    return sync
