"""A model's trainable parameters seen as one flat vector: one message, one collective.

Update rules (``rankwise.updates``) and pipeline stages move whole models (parameters or
gradients) between ranks. Packing them into a
single contiguous buffer turns N small transfers into one, and gives the wire protocol a fixed
shape: ``numel`` elements of one dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import ConfigError


class FlatParams:
    """Copies between a list of parameters and a flat buffer, in parameter order."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError(
                "the model has no parameter with requires_grad=True",
                fix="pass the model whose parameters the optimizer updates.",
            )
        dtypes = sorted({str(p.dtype) for p in self.params})
        devices = sorted({str(p.device) for p in self.params})
        if len(dtypes) > 1 or len(devices) > 1:
            raise ConfigError(
                f"parameters must share one dtype and one device to travel as one buffer; "
                f"got dtypes {dtypes} on devices {devices}",
                fix="move the model to one device and one dtype first, e.g. model.to(rt.device).",
            )
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)

    def values(self, device: torch.device | None = None) -> torch.Tensor:
        """A new flat tensor holding the parameter values."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        return flat if device is None else flat.to(device)

    def grads(self, device: torch.device | None = None) -> torch.Tensor:
        """A new flat tensor of the gradients; a parameter without a gradient counts as zero."""
        parts = [
            p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
            for p in self.params
        ]
        flat = torch.cat(parts)
        return flat if device is None else flat.to(device)

    def load_values(self, flat: torch.Tensor) -> None:
        """Overwrite the parameters (in place, so optimizers keep pointing at them)."""
        self._check(flat)
        with torch.no_grad():
            for p, chunk in zip(self.params, self._chunks(flat), strict=True):
                p.copy_(chunk.view_as(p))

    def load_grads(self, flat: torch.Tensor) -> None:
        """Overwrite (or create) every parameter's ``.grad``."""
        self._check(flat)
        for p, chunk in zip(self.params, self._chunks(flat), strict=True):
            if p.grad is None:
                p.grad = chunk.view_as(p).to(p.device, copy=True)
            else:
                p.grad.copy_(chunk.view_as(p))

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, [p.numel() for p in self.params]))

    def _check(self, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel:
            raise ConfigError(
                f"flat buffer has {flat.numel()} elements, the model {self.numel}",
                fix="every rank must wrap the same model architecture.",
            )
