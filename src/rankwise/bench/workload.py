"""What every strategy trains: one model, one pool of batches, one loss.

``--model`` is a reference model name ('mlp', 'cnn') or ``module:factory``. The factory is
called with no argument and returns an ``nn.Module``; the data comes from a
``batch(size, seed) -> (inputs, targets)`` function in the same module (or ``--data
module:function``). Integer targets train with cross-entropy, floating ones with MSE.

Every strategy starts from the same initial parameters (the factory runs after
``torch.manual_seed(0)``) and steps through the same pool of global batches in the same order:
step ``i`` uses global batch ``i % POOL``; a process that trains on a share of the batch gets
rows ``[r*B, (r+1)*B)`` of it. So the strategies that are mathematically synchronous
(single, threads, dp, ddp, torch-ddp) end at the same loss; the others show what they cost.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from . import models

POOL = 4
"""Distinct global batches cycled through by every strategy."""

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A resolved ``--model`` (and ``--data``): how to build the model and its batches."""

    label: str
    factory: Callable[[], nn.Module]
    batch_fn: Callable[[int, int], Batch]

    def build(self, device: torch.device) -> nn.Module:
        """A fresh model, identical on every call and every rank (seeded), on ``device``."""
        torch.manual_seed(0)
        return self.factory().to(device)

    def pool(self, global_batch: int, device: torch.device) -> list[Batch]:
        """The ``POOL`` global batches every strategy trains on, in order."""
        out = []
        for k in range(POOL):
            x, y = self.batch_fn(global_batch, 1000 + k)
            out.append((x.to(device), y.to(device)))
        return out


def resolve(model: str, data: str | None = None) -> Workload:
    """The workload named by ``--model`` (and ``--data``); a clear error when it cannot be found."""
    if model in models.MODELS:
        name = model
        return Workload(
            label=name,
            factory=lambda: models.build(name),
            batch_fn=lambda size, seed: models.batch(name, size, seed),
        )
    if ":" not in model:
        raise ConfigError(
            f"--model {model!r} is neither a reference model ({', '.join(models.MODELS)}) "
            "nor module:factory",
            fix="use --model mlp, --model cnn, or --model mypackage.mymodule:make_model.",
        )
    factory = _load(model, "--model")
    if data is None:
        data = f"{model.split(':', 1)[0]}:batch"
    return Workload(label=model, factory=factory, batch_fn=_load(data, "--data"))


def _load(spec: str, flag: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{flag} {spec!r}: cannot import module {module_name!r} ({exc})",
            fix="run from the directory that holds it, or add it to PYTHONPATH.",
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        hint = (
            "define batch(size, seed) -> (inputs, targets) there, or pass --data module:function."
            if flag == "--data"
            else f"define a function {attr}() -> nn.Module in {module_name}."
        )
        raise ConfigError(f"{flag} {spec!r}: {module_name} has no function {attr!r}", fix=hint)
    return fn


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class labels (integer targets), mean squared error otherwise."""
    if target.is_floating_point():
        return F.mse_loss(output, target)
    return F.cross_entropy(output, target)


def shard(batch: Batch, index: int, parts: int) -> Batch:
    """Rows ``[index*b, (index+1)*b)`` of a global batch split in ``parts`` equal shares."""
    x, y = batch
    size = x.shape[0] // parts
    return x[index * size : (index + 1) * size], y[index * size : (index + 1) * size]


@torch.no_grad()
def evaluate(model: nn.Module, pool: list[Batch]) -> float:
    """Mean loss of ``model`` over the pool (train mode: BatchNorm uses batch statistics)."""
    return sum(loss_fn(model(x), y).item() for x, y in pool) / len(pool)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient one synchronous step all-reduces (trainable parameters, their dtype)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
