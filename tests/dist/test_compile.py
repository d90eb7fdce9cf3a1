"""torch.compile with every strategy, both orders: ``torch.compile(model)`` then
``rt.prepare``, and ``rt.prepare`` then ``torch.compile``. Each trains, equals eager training in
one process (fp32), and its ``rt.save`` loads into a plain module. backend="aot_eager" traces
with dynamo and AOTAutograd as inductor does, without the C++ build (minutes on 2 CPU cores);
one case runs inductor itself. All cases of a world size run in one spawned job."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

pytestmark = pytest.mark.slow

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _eager() -> dict[str, torch.Tensor]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        F.cross_entropy(model(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(strategy: str, order: str, backend: str, workdir: str) -> dict[str, torch.Tensor]:
    rt = rw.init(strategy=strategy, **({"devices": ["cpu", "cpu"]} if strategy == "dp" else {}))
    model = _net()
    if order == "compile-then-prepare":
        model = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with contextlib.redirect_stderr(io.StringIO()):
        model, opt = rt.prepare(model, opt)
    if order == "prepare-then-compile":
        model = torch.compile(model, backend=backend)
    per = 8 // rt.world_size if strategy != "dp" else 8
    for step in range(STEPS):
        x, y = _batch(step)
        lo = rt.rank * per if strategy != "dp" else 0
        loss = F.cross_entropy(model(x[lo : lo + per]), y[lo : lo + per])
        rt.backward(loss)
        opt.step()
        opt.zero_grad()
    path = os.path.join(workdir, f"{strategy}-{order}.pt")
    rt.save(path, model=model, optimizer=opt)
    plain = _net()
    rw.load_checkpoint(path, model=plain)
    return plain.state_dict()


ORDERS = ("compile-then-prepare", "prepare-then-compile")


def _all(
    strategies: list[str], backend: str, workdir: str, orders: tuple[str, ...] = ORDERS
) -> dict[str, float | str]:
    torch.set_num_threads(1)
    want, out = _eager(), {}
    for strategy in strategies:
        for order in orders:
            torch._dynamo.reset()
            try:
                got = _train(strategy, order, backend, workdir)
                out[f"{strategy}/{order}"] = max((got[k] - want[k]).abs().max().item() for k in want)
            except Exception:
                out[f"{strategy}/{order}"] = traceback.format_exc()
            rw.shutdown()
    return out


def _check(results: dict[str, float | str]) -> None:
    bad = {k: v for k, v in results.items() if isinstance(v, str) or not v <= 1e-5}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_compile_in_either_order_under_single_and_dp_equals_eager(tmp_path):
    _check(run_distributed(_all, 1, args=(["single", "dp"], "aot_eager", str(tmp_path)),
                           init=False, timeout=280)[0])  # fmt: skip


def test_compile_in_either_order_under_ddp_and_zero_equals_eager(tmp_path):
    strategies = ["ddp", "zero1", "zero2", "zero3"]
    ranks = run_distributed(_all, 2, args=(strategies, "aot_eager", str(tmp_path)),
                            init=False, timeout=280)  # fmt: skip
    for results in ranks:
        _check(results)
        assert len(results) == 2 * len(strategies)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler")
def test_inductor_compile_before_prepare_under_zero3_equals_eager(tmp_path):
    args = (["zero3"], "inductor", str(tmp_path), ORDERS[:1])
    ranks = run_distributed(_all, 2, args=args, init=False, timeout=280)
    for results in ranks:
        _check(results)
