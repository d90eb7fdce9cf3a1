"""Step anatomy on a GPU (``rankwise.timing``): the forward and backward of the steps that are
gathered are timed with CUDA events, not host clocks (a GPU runs the work after the host has
returned). Marked ``gpu``: skipped without CUDA (``benchmarks/gpu_check.sh`` runs ``-m gpu``).

A device-side slow backward (``torch.cuda._sleep`` inside a backward hook: the host returns at
once, the GPU is busy) must show in the backward time of the recorded steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.timing.files import read_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _train(sleep_cycles: int, steps: int = 12) -> None:
    rt = rw.init(device="cuda")
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = rt.prepare(model, opt)
    x = torch.randn(64, 256, device=rt.device)
    for _ in range(steps):
        loss = model(x).square().mean()
        if sleep_cycles:
            loss.register_hook(lambda g: torch.cuda._sleep(sleep_cycles) or g)
        loss.backward()
        opt.step()
        opt.zero_grad()
    rw.shutdown()


def test_device_phases_are_timed_with_cuda_events(tmp_path, monkeypatch):
    rows = {}
    for name, cycles in (("plain", 0), ("slow", 200_000_000)):  # ~0.1 s of GPU time
        folder = tmp_path / name
        monkeypatch.setenv("RANKWISE_RUN_DIR", str(folder))
        monkeypatch.setenv("RANKWISE_PROFILE_STEPS", "4")
        _train(cycles)
        records = read_jsonl(folder / "steps.jsonl")
        assert [r["step"] for r in records] == [4, 8, 12]
        rows[name] = records[-1]["ranks"][0]
        assert rows[name]["forward"] > 0 and rows[name]["backward"] > 0
        assert rows[name]["mem"] > 0  # torch.cuda.memory_allocated
    # the GPU's sleep is in the backward, though the host returned at once
    assert rows["slow"]["backward"] > rows["plain"]["backward"] + 0.02, rows
