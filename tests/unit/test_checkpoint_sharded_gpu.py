"""Sharded checkpoints on CUDA (skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them):
a CUDA model's shards are written from device memory and read straight back into it; a
background save stages them into pinned host memory before it returns, so the steps that
follow (on the GPU, asynchronously) do not change what is written."""

from __future__ import annotations

import pytest
import torch

import rankwise as rw

pytestmark = [pytest.mark.gpu]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _step(model, opt) -> None:
    model(torch.randn(16, 64, device="cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_cuda_model_saves_sharded_and_loads_on_cuda_and_on_the_cpu(tmp_path):
    rt = rw.init(strategy="single", device="cuda")
    model = _model()
    model, opt = rt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _step(model, opt)
    at_call = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    pending = rt.save(tmp_path, model=model, optimizer=opt, step=1, sharded=True, background=True)
    for _ in range(3):
        _step(model, opt)  # queued on the GPU while the thread writes
    assert pending.wait().name == "ckpt-00000001"
    on_gpu = _model().cuda()
    rw.load_checkpoint(tmp_path, model=on_gpu)
    on_cpu = _model()
    rw.load_checkpoint(tmp_path, model=on_cpu)
    for k, v in at_call.items():
        assert torch.equal(on_gpu.state_dict()[k].cpu(), v) and torch.equal(on_cpu.state_dict()[k], v)
    assert on_gpu[0].weight.is_cuda
    rw.shutdown()
