"""rw.SyncBatchNorm equals one process's BatchNorm on the concatenated global batch (issue 43
item 3): forward output, input gradient, weight/bias gradients and running statistics, on
CPU/Gloo, at world 2 and 3 with uneven per-rank batches (one rank empty), for BatchNorm1d/2d/3d
converted by rw.convert_sync_batchnorm; and training under rt.prepare (ddp, zero2, zero3) equals the
one-process run on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

# (BatchNorm class, trailing shape of one sample): every input rank BatchNorm takes.
_KINDS = [
    (nn.BatchNorm1d, (3,)),
    (nn.BatchNorm1d, (3, 5)),
    (nn.BatchNorm2d, (3, 4, 2)),
    (nn.BatchNorm3d, (3, 2, 2, 3)),
]
_SETTINGS = [  # (momentum, affine, dtype, tolerance)
    (0.1, True, torch.float64, 1e-10),
    (None, True, torch.float64, 1e-10),  # cumulative average
    (0.3, False, torch.float32, 2e-5),
]


def _largest(diff):
    return diff.abs().max() if diff.numel() else torch.tensor(0.0)  # a rank with no samples


def _one_kind(kind, shape, sizes, momentum, affine, dtype, rank):
    gen = torch.Generator().manual_seed(len(shape) * 100 + sum(sizes))
    total = sum(sizes)
    start = sum(sizes[:rank])
    bn = kind(shape[0], momentum=momentum, affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.rand(shape[0], generator=gen, dtype=dtype) + 0.5)
            bn.bias.copy_(torch.randn(shape[0], generator=gen, dtype=dtype))
    ours = rw.convert_sync_batchnorm(copy.deepcopy(bn))
    assert isinstance(ours, rw.SyncBatchNorm)
    worst = 0.0
    for _step in range(2):  # two steps: the running statistics' update rule is checked too
        x = (torch.randn(total, *shape, generator=gen, dtype=dtype) * 3 + 7).requires_grad_()
        g = torch.randn(total, *shape, generator=gen, dtype=dtype)
        y = bn(x)
        (y * g).sum().backward()
        mine = x.detach()[start : start + sizes[rank]].clone().requires_grad_()
        y_mine = ours(mine)
        (y_mine * g[start : start + sizes[rank]]).sum().backward()
        diffs = [
            _largest(y_mine - y[start : start + sizes[rank]]),
            _largest(mine.grad - x.grad[start : start + sizes[rank]]),
            (ours.running_mean - bn.running_mean).abs().max(),
            (ours.running_var - bn.running_var).abs().max(),
        ]
        if affine:  # weight and bias gradients are local sums: the job's is their sum
            for p_ours, p_ref in ((ours.weight, bn.weight), (ours.bias, bn.bias)):
                summed = rw.all_reduce_sum(p_ours.grad.clone())
                diffs.append((summed - p_ref.grad).abs().max())
                p_ours.grad, p_ref.grad = None, None
        worst = max(worst, *(float(d) for d in diffs))
        if sizes[rank] >= 2 and _step == 0:  # the control: local statistics are far off
            local = copy.deepcopy(bn)  # the same weights, this rank's own statistics
            assert float(_largest(local(mine) - y[start : start + sizes[rank]])) > 1e-3
    assert int(ours.num_batches_tracked) == int(bn.num_batches_tracked) == 2
    ours.eval(), bn.eval()  # eval mode: the running statistics, no communication
    x = torch.randn(2, *shape, generator=gen, dtype=dtype)
    return max(worst, float((ours(x) - bn(x)).abs().max()))


def _against_one_process(sizes):
    rank = rw.get_runtime().rank
    torch.manual_seed(0)
    results = {}
    for kind, shape in _KINDS:
        for momentum, affine, dtype, tol in _SETTINGS:
            name = f"{kind.__name__}{shape} momentum={momentum} affine={affine} {dtype}"
            results[name] = (_one_kind(kind, shape, sizes, momentum, affine, dtype, rank), tol)
    return results


@pytest.mark.parametrize("sizes", [(3, 5), (4, 1, 2), (2, 0, 3)])
def test_sync_batchnorm_equals_one_process_on_the_global_batch(sizes):
    ranks = run_distributed(_against_one_process, len(sizes), args=(list(sizes),), timeout=180)
    for results in ranks:
        bad = {k: d for k, (d, tol) in results.items() if not d <= tol}
        assert not bad, bad


def _net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))


def _data(steps, global_batch):
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(global_batch, 4, generator=gen) * 2 + 1,
             torch.randn(global_batch, 1, generator=gen)) for _ in range(steps)]  # fmt: skip


def _train_prepared(strategy, per_rank, steps, convert=True):
    rt = rw.init(strategy=strategy)
    model = rw.convert_sync_batchnorm(_net()) if convert else _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.prepare(model, opt)
    for x, y in _data(steps, per_rank * rt.world_size):
        mine = slice(rt.rank * per_rank, (rt.rank + 1) * per_rank)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    # Our wrappers' state_dict has no 'module.' prefix; zero2 keeps whole parameters.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rw.shutdown()
    return state


def _one_process(per_rank, world, steps):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data(steps, per_rank * world):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _in_turn(cases: dict) -> dict:
    """Every case in one job, each shutting its runtime down: two ranks start once (each start
    imports torch: seconds of CPU) instead of once per case."""
    return {name: fn(*args) for name, (fn, args) in cases.items()}


@pytest.fixture(scope="module")
def prepared_runs() -> list[dict]:
    """Ranks' results of the cases below (2 samples per rank, 3 steps; 4 for the warnings)."""
    cases = {s: (_train_prepared, (s, 2, 3)) for s in ("ddp", "zero2", "zero3")}
    cases["ddp unconverted"] = (_train_prepared, ("ddp", 2, 3, False))
    cases |= {f"warn {s}": (_prepared_warnings, (s, 4, False, w)) for s, w in WARN_CASES}
    return run_distributed(_in_turn, 2, args=(cases,), init=False, timeout=400)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_training_with_sync_batchnorm_under_prepare_equals_one_process(strategy, prepared_runs):
    per_rank, world, steps = 2, 2, 3  # 2 samples per rank: plain BatchNorm would be far off
    ranks = [by_case[strategy] for by_case in prepared_runs]
    want = _one_process(per_rank, world, steps)
    for state in ranks:
        assert set(state) == set(want)
        for k in want:
            assert torch.allclose(state[k].float(), want[k].float(), atol=1e-5), k


def test_without_conversion_the_same_training_is_far_from_one_process(prepared_runs):
    """The control: plain BatchNorm on 2 samples per rank is what the tests above catch."""
    per_rank, world, steps = 2, 2, 3
    ranks = [by_case["ddp unconverted"] for by_case in prepared_runs]
    want = _one_process(per_rank, world, steps)
    assert max((ranks[0][k].float() - want[k].float()).abs().max() for k in want) > 1e-2


def _prepared_warnings(strategy, per_rank, convert, with_loader):
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    rt = rw.init(strategy=strategy)
    model = rw.convert_sync_batchnorm(_net()) if convert else _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8 * per_rank, 4), torch.randn(8 * per_rank, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if with_loader:
            model, opt, loader = rt.prepare(model, opt, DataLoader(data, batch_size=per_rank))
            x, y = next(iter(loader))
        else:
            model, opt = rt.prepare(model, opt)
            x, y = data[:per_rank]
        F.mse_loss(model(x), y).backward()
    rw.shutdown()
    return [str(w.message) for w in caught if "BatchNorm" in str(w.message)]


WARN_CASES = [("ddp", True), ("zero2", False)]


@pytest.mark.parametrize("strategy,with_loader", WARN_CASES)
def test_prepare_warns_when_batchnorm_meets_a_small_per_rank_batch(strategy, with_loader,
                                                                    prepared_runs):  # fmt: skip
    said = [by_case[f"warn {strategy}"] for by_case in prepared_runs]
    (message,) = said[0]
    assert "1 (BatchNorm1d)" in message  # the layer
    assert "own 4 sample(s)" in message and "below 16" in message  # the batch, the threshold
    assert "rw.convert_sync_batchnorm(model)" in message  # the fix
    assert said[1] == []  # rank 0 says it for the job


def _quiet_cases():
    # Converted, or a batch of 16 per rank: nothing to say.
    return (_prepared_warnings("ddp", 4, True, True), _prepared_warnings("ddp", 16, False, True))


def test_prepare_says_nothing_with_sync_batchnorm_or_a_large_batch():
    for converted, large in run_distributed(_quiet_cases, 2, init=False, timeout=180):
        assert converted == [] and large == []
