"""rw.split: equality with the unsplit model, the GPipe schedule as run, balancing, errors."""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.pipeline import (
    balance_by_params,
    bubble_fraction,
    gpipe_clock,
    measured_bubble,
)
from rankwise.pipeline.partition import balance_by_weight


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12),
        nn.GELU(), nn.Linear(12, 3),
    )  # fmt: skip


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(
        (x.detach().cpu() - y.detach().cpu()).abs().max().item() for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    ("devices", "balance"),
    [(["cpu", "cpu"], None), (["cpu", "cpu", "cpu"], [3, 2, 2])],
    ids=["2-stages-auto", "3-stages-explicit"],
)
@pytest.mark.parametrize(("chunks", "batch"), [(1, 8), (2, 8), (4, 8), (4, 10), (3, 7)])
def test_split_equals_unsplit_outputs_and_gradients(devices, balance, chunks, batch):
    ref = _mlp()
    pipe = rw.split(copy.deepcopy(ref), devices=devices, balance=balance, chunks=chunks)
    assert len(pipe.partitions) == len(devices)
    x = torch.randn(batch, 6)
    x_ref, x_pipe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_pipe = ref(x_ref), pipe(x_pipe)
    assert y_pipe.shape == y_ref.shape
    assert _max_diff([y_pipe], [y_ref]) <= 1e-6
    weight = torch.randn_like(y_ref)  # a loss whose gradient differs per sample
    (y_ref * weight).sum().backward()
    (y_pipe * weight).sum().backward()
    assert (
        _max_diff([p.grad for p in pipe.parameters()], [p.grad for p in ref.parameters()]) <= 1e-6
    )
    assert _max_diff([x_pipe.grad], [x_ref.grad]) <= 1e-6
    # Every micro-batch went through every stage exactly once.
    m = min(chunks, batch)
    ran = sorted((e.stage, e.micro_batch) for e in pipe.last_schedule)
    assert ran == sorted(itertools.product(range(len(devices)), range(m)))


def test_split_trains_like_unsplit_and_keeps_state_dict_keys():
    ref = _mlp(1)
    pipe = rw.split(copy.deepcopy(ref), devices=["cpu", "cpu", "cpu"], chunks=3)
    assert list(pipe.state_dict()) == list(ref.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, pipe)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        x, y = torch.randn(9, 6, generator=gen), torch.randn(9, 3, generator=gen)
        for model, opt in zip((ref, pipe), opts, strict=True):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert _max_diff(list(pipe.parameters()), list(ref.parameters())) <= 1e-6
    ref.load_state_dict(pipe.state_dict())  # portable both ways: same keys


def test_schedule_follows_gpipe_order():
    pipe = rw.split(_mlp(), devices=["cpu"] * 3, balance=[3, 2, 2], chunks=4)
    pipe(torch.randn(16, 6))
    events = {(e.stage, e.micro_batch): e for e in pipe.last_schedule}
    assert sorted(events) == sorted(p for tick in gpipe_clock(4, 3) for p in tick)
    for (j, i), e in events.items():
        assert e.start <= e.end
        if i > 0:  # a stage takes micro-batches in order ...
            assert e.start >= events[(j, i - 1)].end
        if j > 0:  # ... and only after the previous stage has finished that micro-batch
            assert e.start >= events[(j - 1, i)].end


class _Rendezvous(nn.Module):
    """Waits at a barrier on chosen calls: proof that two stages run at the same time."""

    def __init__(self, barrier: threading.Barrier, on_calls: set[int]) -> None:
        super().__init__()
        self.barrier, self.on_calls, self.calls = barrier, on_calls, 0

    def forward(self, x):
        if self.calls in self.on_calls:
            self.barrier.wait(timeout=30)  # BrokenBarrierError if the stages ran one by one
        self.calls += 1
        return x * 2


def test_stages_overlap_in_time():
    # GPipe tick k: stage j runs micro-batch k - j. With 3 stages and 3 micro-batches, tick 2
    # has all three stages busy at once: stage 0 on mb 2, stage 1 on mb 1, stage 2 on mb 0.
    barrier = threading.Barrier(3)
    layers = [_Rendezvous(barrier, {2 - j}) for j in range(3)]
    pipe = rw.split(nn.Sequential(*layers), devices=["cpu"] * 3, balance=[1, 1, 1], chunks=3)
    out = pipe(torch.ones(3, 2))
    assert torch.equal(out, torch.full((3, 2), 8.0))
    ev = {(e.stage, e.micro_batch): e for e in pipe.last_schedule}
    latest_start = max(ev[(j, 2 - j)].start for j in range(3))
    assert all(ev[(j, 2 - j)].end >= latest_start for j in range(3))
    assert measured_bubble(pipe.last_schedule) < 1.0


def test_no_grad_reaches_the_stage_threads():
    pipe = rw.split(_mlp(), devices=["cpu", "cpu"], chunks=2)
    with torch.no_grad():
        assert not pipe(torch.randn(4, 6)).requires_grad
    assert pipe(torch.randn(4, 6)).requires_grad


def test_stage_error_is_raised_in_caller_with_stage_and_micro_batch():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("bad activation")

    pipe = rw.split(nn.Sequential(nn.Linear(2, 2), Boom()), devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match="bad activation") as info:
        pipe(torch.randn(4, 2))
    notes = getattr(info.value, "__notes__", ["(in pipeline stage 1 on cpu, micro-batch 0)"])
    assert "(in pipeline stage 1 on cpu, micro-batch 0)" in notes


def test_gpipe_theory():
    assert gpipe_clock(2, 2) == [[(0, 0)], [(0, 1), (1, 0)], [(1, 1)]]
    assert bubble_fraction(1, 4) == 0.75
    assert bubble_fraction(4, 2) == pytest.approx(1 / 5)


def test_balance_by_params_keeps_relu_with_its_linear():
    # weights (params + 1): 113, 1, 273, 1, 205, 1, 40. Three stages: the middle Linear alone
    # (273) is the least possible maximum, reached only by [2, 1, 4].
    assert balance_by_params(_mlp(), 3) == [2, 1, 4]
    assert balance_by_params(_mlp(), 2) == [3, 4]


@pytest.mark.parametrize("seed", range(20))
def test_balance_by_weight_is_optimal(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 8, (1,), generator=gen))
    p = int(torch.randint(1, n + 1, (1,), generator=gen))
    weights = torch.randint(0, 50, (n,), generator=gen).tolist()
    got = balance_by_weight(weights, p)
    assert sum(got) == n and len(got) == p and min(got) >= 1

    def cost(sizes):
        bounds = list(itertools.accumulate(sizes, initial=0))
        return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))

    brute = min(
        cost([b - a for a, b in itertools.pairwise((0, *cuts, n))])
        for cuts in itertools.combinations(range(1, n), p - 1)
    )
    assert cost(got) == brute


# --- errors: the user's value and the fix -------------------------------------------------


def test_error_balance_sum():
    with pytest.raises(rw.ConfigError) as info:
        rw.split(_mlp(), devices=["cpu", "cpu"], balance=[3, 3])
    assert str(info.value) == (
        "balance=[3, 3] sums to 6 but the model has 7 layers\n"
        "Fix: make the layer counts add up to 7, or balance=None to balance by parameter count."
    )


def test_error_zero_size_stage():
    with pytest.raises(rw.ConfigError, match=r"balance=\[7, 0\] has a stage with no layers"):
        rw.split(_mlp(), devices=["cpu", "cpu"], balance=[7, 0])


def test_error_balance_length():
    with pytest.raises(rw.ConfigError, match=r"balance=\[7\] has 1 entries but there are 2 stage"):
        rw.split(_mlp(), devices=["cpu", "cpu"], balance=[7])


def test_error_more_devices_than_layers():
    with pytest.raises(rw.ConfigError, match="cannot split 2 layers over 3 stages") as info:
        rw.split(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), devices=["cpu"] * 3)
    assert "Fix: use at most 2 devices/ranks" in str(info.value)


def test_error_non_sequential_module():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x) + self.b(x)

    with pytest.raises(rw.ConfigError, match=r"cannot split a Net: only nn\.Sequential") as info:
        rw.split(Net(), devices=["cpu", "cpu"])
    assert "Fix: write the model as nn.Sequential(layer1, layer2, ...)" in str(info.value)


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="this machine has cuda:3")
def test_error_device_that_does_not_exist():
    count = torch.cuda.device_count()
    with pytest.raises(rw.ConfigError) as info:
        rw.split(_mlp(), devices=["cpu", "cuda:3"])
    msg = str(info.value)
    assert msg.startswith(f"devices[1]='cuda:3' does not exist: this machine has {count} cuda")
    assert "Fix: use devices among:" in msg


def test_error_bad_chunks_and_devices():
    with pytest.raises(rw.ConfigError, match=r"chunks=0 must be an integer >= 1"):
        rw.split(_mlp(), devices=["cpu"], chunks=0)
    with pytest.raises(rw.ConfigError, match=r"devices='cpu' must be a non-empty list"):
        rw.split(_mlp(), devices="cpu")
    with pytest.raises(rw.ConfigError, match=r"devices\[0\]='gpu0' is not a device name"):
        rw.split(_mlp(), devices=["gpu0"])


def test_moving_a_split_model_is_refused_but_dtype_changes_work():
    pipe = rw.split(_mlp(), devices=["cpu", "cpu"])
    with pytest.raises(rw.ConfigError, match=r"\.to\(cpu\) would move every stage"):
        pipe.to("cpu")
    with pytest.raises(rw.ConfigError, match=r"\.cuda\(\) would move every stage"):
        pipe.cuda()
    pipe.to(torch.float64)
    assert pipe(torch.randn(2, 6, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_split_over_two_gpus_equals_unsplit():
    ref = _mlp()
    pipe = rw.split(copy.deepcopy(ref), devices=["cuda:0", "cuda:1"], chunks=4)
    assert {p.device.index for p in pipe.parameters()} == {0, 1}
    x = torch.randn(10, 6)
    y = pipe(x)
    assert y.device == torch.device("cuda:1")
    assert _max_diff([y], [ref(x)]) <= 1e-5
