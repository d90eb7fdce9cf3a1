"""How much training state each rank holds per strategy, and which ZeRO stage makes a model fit.

With P trainable parameters of b bytes, k optimizer states per parameter (AdamW: 2 moments,
SGD with momentum: 1) and N ranks, the training state per rank (activations excluded) is:

==========  ==========================  ===========================
strategy    bytes per rank              fp32 AdamW (b=4, k=2)
==========  ==========================  ===========================
ddp         b*P*(2 + k)                 16P
zero1       b*P*(2 + k/N)               8P + 8P/N
zero2       b*P*(1 + (1 + k)/N)         4P + 12P/N
zero3       b*P*(2 + k)/N               16P/N (+ the gathered units)
==========  ==========================  ===========================

Stage 3 also holds, briefly, the full parameters of the unit being computed and of the
``prefetch`` ones (default 1) gathered ahead of it; stages 2 and 3 hold the full gradients of
the unit being computed and, on a GPU, of one more while it is reduced (on the CPU each
reduction is waited for at once: ``sharded._IN_FLIGHT``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ... import strategies


def order() -> tuple[str, ...]:
    """The multi-process strategies from most to least memory: ddp, zero1, zero2, zero3."""
    return tuple(s.name for s in strategies.multi_process())


def optimizer_states(optimizer: torch.optim.Optimizer | None) -> int:
    """Per-parameter state tensors the optimizer keeps (2 for Adam-like; unknown: 2)."""
    if optimizer is None:
        return 2
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if optimizer.defaults.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adagrad, torch.optim.RMSprop)):
        return 1
    return 2


def bytes_per_rank(
    params: int, world: int, strategy: str, *, element_bytes: int = 4, states: int = 2
) -> int:
    """Training state (parameters, gradients, optimizer state) one rank holds under
    ``strategy`` (any registered name: what it shards is held 1/``world`` per rank)."""
    p, n = params * element_bytes, max(world, 1)
    sharded = strategies.get(strategy).shards
    share = {part: 1 / n if part in sharded else 1 for part in strategies.SHARDED}
    held = p * share["parameters"] + p * share["gradients"] + p * states * share["optimizer"]
    return round(held)


def capacity_bytes(device: torch.device, local_world_size: int) -> int | None:
    """Memory one rank may use: the GPU's, or this machine's RAM shared by its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return ram // max(local_world_size, 1)


def advice(
    model: nn.Module,
    world: int,
    capacity: int | None,
    optimizer: torch.optim.Optimizer | None = None,
    current: str = "ddp",
) -> str | None:
    """A sentence naming the first stage whose state fits ``capacity`` when ``current``'s does
    not (``current``: any registered strategy), else None."""
    trainable = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    if capacity is None or not trainable:
        return None
    count = sum(p.numel() for p in trainable)
    size, k = trainable[0].element_size(), optimizer_states(optimizer)
    need = {
        s: bytes_per_rank(count, world, s, element_bytes=size, states=k)
        for s in (current, *order())
    }
    if need[current] <= capacity:
        return None
    gib = 2**30
    stage = strategies.get(current).zero_stage
    later = [s.name for s in strategies.multi_process() if s.zero_stage > stage]
    fits = next((s for s in later if need[s] <= capacity), None)
    head = (
        f"the model's training state needs {need[current] / gib:.1f} GiB per rank under "
        f"strategy='{current}' ({count / 1e6:.1f}M parameters of {size} bytes, {k} optimizer "
        f"states each, {world} ranks), more than the {capacity / gib:.1f} GiB this rank has"
    )
    if fits is None:
        return head + "; use more ranks, or a smaller model or optimizer (see docs/zero.md)"
    return head + (
        f"; strategy='{fits}' needs {need[fits] / gib:.1f} GiB per rank "
        f"(rw.init(strategy='{fits}'); see docs/zero.md)"
    )
