"""One loop, three strategies: single, dp (2 CPU replicas) and ddp (world 2) train identically.

``train`` below is the user's training loop. Only ``rw.init(strategy=...)`` changes between
the runs; with the same global batch, every run must end with the same parameters.
"""

from __future__ import annotations

import contextlib
import io

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.testing import run_distributed

STEPS_PER_EPOCH = 4
EPOCHS = 2
GLOBAL_BATCH = 16


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS_PER_EPOCH * GLOBAL_BATCH, 1, 6, 6, generator=g)
    return TensorDataset(x, torch.randint(0, 3, (len(x),), generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def train(strategy: str, devices: list[str] | None, batch_size: int, use_global: bool):
    """The user's loop: the same code under every strategy. Returns params and the batch log."""
    rt = rw.init(strategy=strategy, devices=devices)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    loader = DataLoader(_data(), batch_size=batch_size, shuffle=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        kwargs = {"global_batch_size": GLOBAL_BATCH} if use_global else {}
        model, opt, loader = rt.prepare(model, opt, loader, **kwargs)
    steps = 0
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            assert x.device == rt.device and y.device == rt.device
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps += 1
    params = {k: v.detach().cpu().clone() for k, v in rw.unwrap_model(model).state_dict().items()}
    return params, steps, err.getvalue(), rt.strategy


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_single_dp_and_ddp_reach_the_same_parameters():
    single, steps, _, name = train("single", None, GLOBAL_BATCH, True)
    assert name == "single" and steps == EPOCHS * STEPS_PER_EPOCH
    rw.shutdown()
    # dp: global_batch_size= decides; the DataLoader's batch_size=5 is not used.
    dp, dp_steps, dp_log, name = train("dp", ["cpu", "cpu"], 5, True)
    assert name == "dp" and dp_steps == steps
    rw.shutdown()
    # ddp: the DataLoader's batch_size keeps torch's meaning (per process), global = 8 x 2.
    ranks = run_distributed(
        train, 2, args=("ddp", None, GLOBAL_BATCH // 2, False), init=False, timeout=120
    )
    ddp0, ddp_steps, log0, name = ranks[0]
    ddp1, _, log1, _ = ranks[1]
    assert name == "ddp" and ddp_steps == steps
    # The same global batch gives the same parameters, whatever runs the loop.
    assert _max_diff(single, dp) <= 1e-6
    assert _max_diff(single, ddp0) <= 1e-6
    assert _max_diff(ddp0, ddp1) == 0.0
    # And training moved them: the comparison is not between two untouched models.
    assert _max_diff(single, _net().state_dict()) > 1e-2
    # The batch-size meaning is logged once, by rank 0 only.
    assert log0 == (
        "[rank 0/2] rankwise prepare [ddp]: batch_size=8 is per process (torch DDP's meaning): "
        "global batch 16 = 8 per process x 2 processes\n"
    )
    assert log1 == ""
    assert dp_log == (
        "[rank 0/1] rankwise prepare [dp]: global_batch_size=16 (the DataLoader's batch_size=5 "
        "is not used): global batch 16 = 8 per device x 2 devices\n"
    )
