"""Reference models and synthetic batches for benchmarks (shared by every benchmark script).

- ``mlp()``: a 10.5M-parameter MLP (1024 -> 2048 -> 2048 -> 2048 -> 10), communication-heavy:
  42 MB of fp32 gradients per step for little compute.
- ``cnn()``: a small 3-block CNN with BatchNorm on 3x32x32 images (24k parameters),
  compute-heavy: a few hundred KB of gradients per step, and buffers to broadcast.

``batch(name, size, seed)`` makes a deterministic synthetic batch for either model, so that
benchmarks (and tests) can feed every strategy the same inputs without downloading data.
"""

from __future__ import annotations

import torch
from torch import nn

MODELS = ("mlp", "cnn")


def mlp(
    in_features: int = 1024, hidden: int = 2048, depth: int = 3, classes: int = 10
) -> nn.Module:
    """``depth`` hidden layers of width ``hidden`` with ReLU; 10.5M parameters by default."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def cnn(channels: int = 3, classes: int = 10, width: int = 16) -> nn.Module:
    """Three conv-BN-ReLU blocks (widths ``width``, 2x, 4x), global pooling, a linear head."""

    def block(cin: int, cout: int, pool: bool) -> list[nn.Module]:
        out: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        return [*out, nn.MaxPool2d(2)] if pool else out

    return nn.Sequential(
        *block(channels, width, False),
        *block(width, 2 * width, True),
        *block(2 * width, 4 * width, True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )


def build(name: str) -> nn.Module:
    """The reference model called ``name`` ('mlp' or 'cnn'), default sizes."""
    if name == "mlp":
        return mlp()
    if name == "cnn":
        return cnn()
    raise ValueError(f"model={name!r} is not one of {MODELS}")


def batch(name: str, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic synthetic (inputs, labels) batch for model ``name``."""
    g = torch.Generator().manual_seed(seed)
    shape = (size, 1024) if name == "mlp" else (size, 3, 32, 32)
    return torch.randn(shape, generator=g), torch.randint(0, 10, (size,), generator=g)


def num_parameters(model: nn.Module) -> int:
    """Number of trainable parameter elements (shared tensors counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
