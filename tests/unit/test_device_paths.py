"""The CPU-checkable parts of the device paths (docs/ddp.md, docs/dp.md: CUDA streams).

Thread-local state (autocast, grad mode, streams) must follow work into helper threads, and a
copy to the CPU must never be asynchronous. The CUDA halves are in tests/dist/test_gpu_paths.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.parallel.agreement import move_to_device
from rankwise.pipeline.execution import gpipe as schedule


def test_moves_to_the_cpu_are_synchronous(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("non_blocking", False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    t = torch.ones(2)
    moved = move_to_device((t, [t], {"k": t}), torch.device("cpu"))
    assert seen == [False, False, False]
    assert torch.equal(moved[2]["k"], t)


def test_pipeline_stage_threads_run_under_the_callers_autocast() -> None:
    torch.manual_seed(0)
    pipe = rw.split(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), ["cpu", "cpu"])
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.chunks = 3  # stage threads
        piped = pipe(x)
        pipe.chunks = 1  # the caller's thread
        sequential = pipe(x)
    assert {e.stage for e in pipe.last_schedule} == {0, 1}
    assert piped.dtype == sequential.dtype == torch.bfloat16
    torch.testing.assert_close(piped, sequential)


def test_pipeline_stage_threads_keep_the_callers_grad_mode() -> None:
    pipe = rw.split(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), ["cpu", "cpu"], chunks=2)
    with torch.no_grad():
        assert not pipe(torch.randn(4, 4)).requires_grad
    assert pipe(torch.randn(4, 4)).requires_grad


def test_a_stage_whose_thread_setup_fails_raises_instead_of_hanging() -> None:
    def setup(j: int) -> None:
        if j == 1:
            raise RuntimeError("stage 1 could not enter its stream")

    stages = [lambda i, x: x + 1, lambda i, x: x * 2]
    with pytest.raises(RuntimeError, match="stage 1 could not enter its stream"):
        schedule.run_pipelined(stages, [torch.ones(1), torch.ones(1)], setup)
