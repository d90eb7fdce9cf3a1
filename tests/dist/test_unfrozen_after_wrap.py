"""A parameter frozen when the engine was built and unfrozen later is refused at the next
training forward, under DistributedDataParallel and every ZeRO stage.

The engine keeps nothing for it (no bucket, no shard): before, under DDP each rank trained its
own copy of it (the replicas drifted apart, silently, as under torch's DDP) and under ZeRO it
never changed. Now the forward raises a ``ModelError`` naming the engine, the parameters and the
fix; an evaluation under ``no_grad`` is left alone, and so is a layer that stays frozen.
"""

from __future__ import annotations

import torch
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

ENGINES = ("ddp", "zero1", "zero2", "zero3")


def _wrap(engine: str, net: nn.Module):
    if engine == "ddp":
        model = rw.DistributedDataParallel(net)
        return model, torch.optim.SGD(net.parameters(), lr=0.1)
    model = rw.ShardedDataParallel(net, lambda ps: torch.optim.SGD(ps, lr=0.1),
                                   stage=int(engine[-1]))  # fmt: skip
    return model, model.optimizer


def _every_engine() -> dict:
    out = {}
    for engine in ENGINES:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        net[0].requires_grad_(False)
        model, opt = _wrap(engine, net)
        for _ in range(2):  # frozen as when wrapped: it trains
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        net[0].weight.requires_grad_(True)
        with torch.no_grad():
            model(torch.randn(4, 8))  # an evaluation builds no gradient
        try:
            model(torch.randn(4, 8))
            out[engine] = "no error"
        except rw.ConfigError as exc:
            out[engine] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_parameter_unfrozen_after_wrapping_is_refused_by_every_engine():
    for rank, got in enumerate(run_distributed(_every_engine, 2, timeout=180)):
        for engine, text in got.items():
            name = "DistributedDataParallel" if engine == "ddp" else "ShardedDataParallel"
            assert text.startswith(f"ModelError: [rank {rank}] 1 parameter(s)"), (engine, text)
            assert f"requires_grad=False when {name} was built" in text, (engine, text)
            assert "require grad now: 0.weight." in text, (engine, text)
            assert "Fix: set requires_grad before wrapping" in text, (engine, text)
