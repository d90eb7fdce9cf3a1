"""The training-loop verbs across processes (world 2), each against a single-process oracle
written with torch alone: mixed precision, loss scaling, clipping, accumulation, ordering, rt.log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.testing import run_distributed

BATCH = 8  # per rank; the oracle sees the two ranks' batches concatenated


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(2 * BATCH, 6, generator=g), torch.randint(0, 3, (2 * BATCH,), generator=g))
        for _ in range(steps)
    ]


def _mine(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[rank * BATCH : (rank + 1) * BATCH]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in rw.unwrap_model(model).state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# -- bf16-mixed DDP == bf16-mixed single process on the concatenated batch ------------------


def _bf16_ddp(steps: int):
    rt = rw.init(strategy="ddp", precision="bf16-mixed")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.prepare(model, opt)
    for x, y in _batches(steps):
        out = model(_mine(x, rt.rank))
        assert out.dtype == torch.float32  # outputs come back in fp32 for the loss
        rt.backward(F.cross_entropy(out, _mine(y, rt.rank)))
        opt.step()
        opt.zero_grad()
    return _params(model)


def _bf16_oracle(steps: int) -> dict[str, torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_bf16_mixed_ddp_equals_bf16_mixed_single_process():
    ranks = run_distributed(_bf16_ddp, 2, args=(20,), init=False, timeout=120)
    want = _bf16_oracle(20)
    assert _max_diff(ranks[0], ranks[1]) == 0.0
    # bf16 keeps 8 bits of mantissa: the split batch rounds differently than the whole one.
    assert _max_diff(ranks[0], want) < 2e-2
    fp32 = _net().state_dict()
    assert _max_diff(ranks[0], {k: v.float() for k, v in fp32.items()}) > 0.05  # it trained


# -- fp16-mixed: an overflow on one rank skips the step on every rank ------------------------


def _fp16_overflow(steps: int, bad_step: int):
    rt = rw.init(strategy="ddp", precision="fp16-mixed")
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = rt.prepare(model, opt)
    scales, before = [], None
    for i, (x, y) in enumerate(_batches(steps)):
        rt.backward(F.cross_entropy(model(_mine(x, rt.rank)), _mine(y, rt.rank)))
        if i == bad_step:
            before = _params(model)
            if rt.rank == 1:  # after the all-reduce: only this rank sees it
                next(model.parameters()).grad[0, 0] = float("inf")
        opt.step()
        if i == bad_step:
            skipped = _max_diff(before, _params(model)) == 0.0
        opt.zero_grad()
        scales.append(opt.scaler.get_scale())
    counters = sorted(int(s["step"]) for s in opt.state.values())
    return _params(model), counters, scales, skipped


def test_fp16_overflow_on_one_rank_skips_the_same_step_everywhere():
    steps, bad = 6, 3
    (p0, c0, s0, skip0), (p1, c1, s1, skip1) = run_distributed(
        _fp16_overflow, 2, args=(steps, bad), init=False, timeout=120
    )
    assert skip0 and skip1, "both ranks must skip the step with the overflow"
    assert _max_diff(p0, p1) == 0.0
    assert c0 == c1 == [steps - 1] * len(c0)  # Adam's step counter: one step skipped
    assert s0 == s1 and s0[bad] < s0[bad - 1]  # the same (halved) scale on both ranks


# -- clipping: DDP and a 2-stage pipeline against torch's clip on the unsplit model ----------


def _clipped_ddp(steps: int, max_norm: float):
    rt = rw.init(strategy="ddp")
    model = rt.prepare(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for x, y in _batches(steps):
        rt.backward(F.cross_entropy(model(_mine(x, rt.rank)), _mine(y, rt.rank)))
        norms.append(rt.clip_grad_norm_(model, max_norm).item())
        opt.step()
        opt.zero_grad()
    return _params(model), norms


def _clipped_oracle(steps: int, max_norm: float, model: nn.Module | None = None, loss=None):
    model = _net() if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for x, y in _batches(steps):
        (loss or F.cross_entropy)(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
    return _params(model), norms


def test_clipped_ddp_equals_clipped_single_process():
    (p0, n0), (p1, n1) = run_distributed(_clipped_ddp, 2, args=(8, 0.2), init=False, timeout=120)
    want, want_norms = _clipped_oracle(8, 0.2)
    assert n0 == n1  # the same total norm on every rank
    assert max(abs(a - b) for a, b in zip(n0, want_norms, strict=True)) < 1e-5
    assert min(want_norms) > 0.2  # the clip was active at every step
    assert _max_diff(p0, want) <= 1e-6 and _max_diff(p1, want) <= 1e-6


def _pipe_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


def _clipped_pipeline(steps: int, max_norm: float, layout: str):
    rt = rw.get_runtime()
    if layout == "stages":  # one pipeline of two stages
        stage, mine = rw.DistributedPipeline(_pipe_net(), chunks=2), slice(None)
    else:  # two one-stage pipelines, replicas of each other: the norm must not count both
        group = dist.new_group([0, 1])
        stage = rw.DistributedPipeline(_pipe_net(), ranks=[rt.rank], data_parallel_group=group)
        mine = slice(rt.rank * BATCH, (rt.rank + 1) * BATCH)
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    norms = []
    for x, y in _batches(steps):
        stage.train_step(x[mine], y[mine, None].float().repeat(1, 2), F.mse_loss)
        norms.append(rt.clip_grad_norm_(stage, max_norm).item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in stage.state_dict().items()}, norms


def _both_layouts(steps: int, max_norm: float):
    return [_clipped_pipeline(steps, max_norm, layout) for layout in ("stages", "replicas")]


def test_clipped_pipelines_equal_clipped_unsplit_model():
    ranks = run_distributed(_both_layouts, 2, args=(6, 0.2), timeout=120)

    def mse(out, y):
        return F.mse_loss(out, y[:, None].float().repeat(1, 2))

    want, want_norms = _clipped_oracle(6, 0.2, _pipe_net(), mse)
    assert min(want_norms) > 0.2  # the clip was active at every step
    for layout in range(2):  # a 2-stage pipeline; 2 replicas of a 1-stage pipeline
        (part0, norms0), (part1, norms1) = ranks[0][layout], ranks[1][layout]
        assert norms0 == norms1
        assert max(abs(a - b) for a, b in zip(norms0, want_norms, strict=True)) < 1e-5
        for part in (part0, part1):
            assert part and _max_diff(part, {k: want[k] for k in part}) <= 1e-6


# -- accumulation: one all-reduce per group, the same result as one big batch ---------------


def _accumulate(micro: int, steps: int):
    rt = rw.init(strategy="ddp")
    data = TensorDataset(*[torch.cat(t) for t in zip(*_batches(micro), strict=True)])
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    model, opt, loader = rt.prepare(net, opt, DataLoader(data, batch_size=BATCH))
    calls, real = [0], dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    seen, syncs = [], []
    try:
        for x, y in loader:
            before = calls[0]
            with rt.accumulate(model, steps=steps) as acc:  # the mean over the group
                rt.backward(F.cross_entropy(model(x), y))
                if acc.sync:
                    opt.step()
                    opt.zero_grad()
            seen.append((x.clone(), y.clone()))
            syncs.append((acc.sync, calls[0] - before))
    finally:
        dist.all_reduce = real
    return _params(model), seen, syncs


def test_accumulate_under_ddp_communicates_once_per_group_and_equals_the_big_batch():
    micro, steps = 10, 4  # groups of 4, 4 and a short last group of 2
    ranks = run_distributed(_accumulate, 2, args=(micro, steps), init=False, timeout=120)
    (p0, seen0, syncs0), (p1, seen1, _) = ranks
    assert [s for s, _ in syncs0] == [False, False, False, True] * 2 + [False, True]
    assert all(n == 0 for s, n in syncs0 if not s)  # no communication inside a group
    assert all(n >= 1 for s, n in syncs0 if s)
    assert _max_diff(p0, p1) == 0.0
    # Oracle: per group, the sum over micro-batches of (mean loss over both ranks' samples)/steps.
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for i, ((x0, y0), (x1, y1)) in enumerate(zip(seen0, seen1, strict=True)):
        loss = F.cross_entropy(model(torch.cat([x0, x1])), torch.cat([y0, y1])) / steps
        loss.backward()
        if syncs0[i][0]:
            opt.step()
            opt.zero_grad()
    assert _max_diff(p0, _params(model)) <= 1e-6


# -- ordering helpers and metrics ------------------------------------------------------------


def _ordering_and_log(tmp: str):
    rt = rw.get_runtime()
    marker = Path(tmp) / "downloaded"
    with rt.rank_zero_first():
        if rt.rank == 0:
            time.sleep(0.5)  # a slow download: rank 1 must not get ahead of it
            marker.write_text("data")
        first_saw = marker.exists()
    with rt.local_rank_zero_first():
        local_saw = marker.exists()
    rt.log_to(Path(tmp) / "logs", tensorboard=False)
    rt.log({"loss": float(rt.rank + 1), "correct": 10 * (rt.rank + 1)}, step=5, reduce="sum")
    rt.log({"loss": torch.tensor(float(rt.rank))}, reduce="mean")
    return first_saw, local_saw


def test_rank_zero_first_and_log_reduced_on_rank_zero(tmp_path):
    ranks = run_distributed(_ordering_and_log, 2, args=(str(tmp_path),), timeout=120)
    assert ranks == [(True, True), (True, True)]
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(5, 3.0), (6, 0.5)]  # one writer
    assert lines[0]["correct"] == 30.0


# -- rw.launch with an importable function (fresh interpreters) ------------------------------


def _launched(scale: int):
    rt = rw.init()
    print(f"ready {rt.rank}")
    return rt.rank * scale, rt.world_size, rt.strategy


def test_launch_runs_an_importable_function_in_fresh_processes(capsys):
    assert rw.launch(_launched, nprocs=2, args=(3,), timeout=120) == [(0, 2, "ddp"), (3, 2, "ddp")]
    out = capsys.readouterr().out.splitlines()
    assert "[rank 0] ready 0" in out and "[rank 1] ready 1" in out
