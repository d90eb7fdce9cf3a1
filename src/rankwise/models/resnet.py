"""A ResNet-18-shaped image classifier of any width: the vision recipe (docs/recipes.md).

The layout of ResNet-18 (a stem convolution, four stages of two basic residual blocks, the
first block of stages 2-4 halving the resolution, global average pooling, a linear head), with
batch normalisation after every convolution. Batch norm is what makes a vision net different
for data parallelism: its running statistics are buffers, not parameters, so they are not
averaged with the gradients (DDP broadcasts rank 0's at every forward; docs/ddp.md).

    model = resnet18(num_classes=10, width=8)     # 1/8 of ResNet-18's channels: CPU-sized
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(cin: int, cout: int, stride: int, kernel: int = 3) -> list[nn.Module]:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
    return [conv, nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut; a 1x1 convolution on the shortcut when the shape
    changes (``stride`` 2 or a new channel count)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(cin, cout, stride), nn.ReLU(inplace=True), *_conv_bn(cout, cout, 1)
        )
        reshape = stride != 1 or cin != cout
        self.shortcut = nn.Sequential(*_conv_bn(cin, cout, stride, 1)) if reshape else None
        # The last norm of each block starts at zero: the block starts as the identity, which
        # trains deep residual nets faster (the "zero-init residual" of large-batch recipes).
        nn.init.zeros_(self.body[-1].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.shortcut is None else self.shortcut(x)
        return torch.relu(self.body(x) + skip)


class ResNet(nn.Module):
    """``stem -> stages -> pool -> fc``; ``blocks`` per stage, channels ``width * 2**stage``."""

    def __init__(
        self, num_classes: int, width: int = 64, blocks: tuple[int, ...] = (2, 2, 2, 2)
    ) -> None:
        super().__init__()
        # A 3x3 stem without max-pooling: tiny inputs (CIFAR-sized or smaller) keep their
        # resolution for the residual stages.
        self.stem = nn.Sequential(*_conv_bn(3, width, 1), nn.ReLU(inplace=True))
        stages, cin = [], width
        for s, n in enumerate(blocks):
            cout = width * 2**s
            stages.append(
                nn.Sequential(*(BasicBlock(cin if i == 0 else cout, cout, 2 if s and not i else 1)
                                for i in range(n)))
            )  # fmt: skip
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


def resnet18(num_classes: int = 10, width: int = 64) -> ResNet:
    """ResNet-18's layout (2, 2, 2, 2 blocks); ``width=64`` is the original's channel count."""
    return ResNet(num_classes, width, (2, 2, 2, 2))
