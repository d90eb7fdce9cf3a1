"""Activation checkpointing (torch.utils.checkpoint, reentrant and not) under dp and ZeRO 1-3
trains exactly as without it: stage 3 gathers a block's parameters again for the recomputation,
and a reentrant checkpoint's nested backward does not end the engine's backward pass early.
All cases of a world size run in one spawned job. (DDP's side is tests/dist/test_ddp*.py.)"""

from __future__ import annotations

import contextlib
import io
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import rankwise as rw
from rankwise.testing import run_distributed

STEPS, GLOBAL = 3, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """Blocks in a ModuleList (stage 3: one unit each, freed between forward and backward),
    recomputed in backward when asked."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in [*self.blocks, self.out]:  # the output layer too: backward starts inside
            if self.reentrant is None:
                h = layer(h)
            else:
                h = checkpoint(layer, h, use_reentrant=self.reentrant)
        return h


def _net(reentrant: bool | None) -> Net:
    torch.manual_seed(0)
    return Net(reentrant)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL, 6, generator=g), torch.randint(0, 3, (GLOBAL,), generator=g)


def _oracle() -> dict[str, torch.Tensor]:
    model = _net(None)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        F.cross_entropy(model(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(strategy: str, reentrant: bool) -> dict[str, torch.Tensor]:
    rt = rw.init(strategy=strategy, **({"devices": ["cpu", "cpu"]} if strategy == "dp" else {}))
    model = _net(reentrant)
    with contextlib.redirect_stderr(io.StringIO()):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model, opt = rt.prepare(model, opt)  # zero3: one unit per block (the default policy)
    per = GLOBAL if strategy == "dp" else GLOBAL // rt.world_size
    lo = 0 if strategy == "dp" else rt.rank * per
    for step in range(STEPS):
        x, y = _batch(step)
        rt.backward(F.cross_entropy(model(x[lo : lo + per]), y[lo : lo + per]))
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _all(strategies: list[str]) -> dict[str, float | str]:
    torch.set_num_threads(1)
    want, out = _oracle(), {}
    for strategy in strategies:
        for reentrant in (False, True):
            name = f"{strategy}/use_reentrant={reentrant}"
            try:
                got = _train(strategy, reentrant)
                out[name] = max((got[k] - want[k]).abs().max().item() for k in want)
            except Exception:
                out[name] = traceback.format_exc()
            rw.shutdown()
    return out


def _check(results: dict[str, float | str], count: int) -> None:
    assert len(results) == count
    bad = {k: v for k, v in results.items() if isinstance(v, str) or not v <= 1e-5}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_checkpointed_blocks_under_dp_train_as_without_checkpointing():
    _check(run_distributed(_all, 1, args=(["dp"],), init=False, timeout=120)[0], 2)


def test_checkpointed_blocks_under_zero_1_2_3_train_as_without_checkpointing():
    ranks = run_distributed(_all, 2, args=(["zero1", "zero2", "zero3"],), init=False, timeout=200)
    for results in ranks:
        _check(results, 6)
