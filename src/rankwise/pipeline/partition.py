"""Which layers go to which stage: validation of the user's spec and automatic balancing.

Everything here is pure (no threads, no processes): a model and a spec in, a list of layer
counts out, or a ``ConfigError`` that repeats the user's value and says the fix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..validate import sequence, shown


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, layer) pairs of a sequential model, in the order they are applied.

    Only ``nn.Sequential`` (or a subclass that keeps Sequential's forward) says, by its type,
    that its children run one after another on one value; any other module's forward may
    branch, reuse layers or take several inputs, so splitting it at child boundaries would
    silently compute something else.
    """
    is_sequential = isinstance(model, nn.Sequential) and (
        type(model).forward is nn.Sequential.forward
    )
    if not is_sequential:
        raise ConfigError(
            f"cannot split a {type(model).__name__}: only nn.Sequential models (layers applied "
            "one after another, each taking the previous one's output) can be split into stages "
            f"(got model={shown(model)})",
            fix="write the model as nn.Sequential(layer1, layer2, ...) (wrap blocks that branch "
            "or take several inputs in one module each), or place its parts on devices by hand.",
        )
    layers = list(model.named_children())
    if not layers:
        raise ConfigError(
            "cannot split an empty nn.Sequential", fix="give the model at least one layer."
        )
    return layers


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """``balance`` as a list, or an error naming the value and the fix."""
    sequence("balance", balance, "a list of layer counts, one per stage", example="[2, 2]")
    bal = list(balance)
    if len(bal) != num_stages:
        raise ConfigError(
            f"balance={bal} has {len(bal)} entries but there are {num_stages} stages "
            "(one per device/rank)",
            fix=f"give one layer count per stage ({num_stages} numbers), or balance=None to "
            "balance by parameter count.",
        )
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in bal):
        raise ConfigError(
            f"balance={bal} has a stage with no layers (every entry must be an integer >= 1)",
            fix="give every stage at least one layer, or use fewer devices.",
        )
    if sum(bal) != num_layers:
        raise ConfigError(
            f"balance={bal} sums to {sum(bal)} but the model has {num_layers} layers",
            fix=f"make the layer counts add up to {num_layers}, or balance=None to balance "
            "by parameter count.",
        )
    return bal


def balance_by_weight(weights: Sequence[float], num_stages: int) -> list[int]:
    """Split ``weights`` into ``num_stages`` consecutive non-empty groups, minimising the largest.

    The slowest stage sets the pipeline's pace, so the objective is the maximum group weight.
    Exact dynamic programming, O(n^2 p): models have hundreds of layers at most.
    """
    n = len(weights)
    if num_stages > n:
        raise ConfigError(
            f"cannot split {n} layers over {num_stages} stages (every stage needs a layer)",
            fix=f"use at most {n} devices/ranks, or a model with more layers.",
        )
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: the smallest possible largest-group weight for the first i layers in k groups.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def balance_by_params(model: nn.Module, num_stages: int) -> list[int]:
    """Layer counts per stage that even out the number of parameters (memory) per stage.

    Each layer weighs its parameter count plus one, so that parameter-free layers (ReLU) still
    count a little and stay with the layer before them rather than forming a stage of their own.
    """
    weights = [1 + sum(p.numel() for p in layer.parameters()) for _, layer in layers_of(model)]
    return balance_by_weight(weights, num_stages)


def balance_by_time(
    model: nn.Module, sample: torch.Tensor, num_stages: int, *, repeats: int = 3
) -> list[int]:
    """Layer counts per stage that even out measured forward time on ``sample``.

    Runs the model layer by layer (``repeats`` times, keeping the fastest) on the device the
    layers are on now; use a sample of the micro-batch size you will train with.
    """
    layers = [layer for _, layer in layers_of(model)]
    best = [float("inf")] * len(layers)
    with torch.no_grad():
        for _ in range(repeats):
            x = sample
            for idx, layer in enumerate(layers):
                start = time.perf_counter()
                x = layer(x)
                best[idx] = min(best[idx], time.perf_counter() - start)
    return balance_by_weight(best, num_stages)
