"""Model parallel across processes, and data parallel over model-parallel replicas.

Oracle: one unsplit model trained in this (parent) process on the whole global batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

STEPS, LR = 10, 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 2),
    )  # fmt: skip


def _data(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(42)
    return [
        (torch.randn(batch, 5, generator=gen), torch.randn(batch, 2, generator=gen))
        for _ in range(STEPS)
    ]


def _oracle(batch: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _data(batch):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


def _portable(state: dict[str, torch.Tensor]) -> dict[str, object]:
    # Tensors sent back through run_distributed's queue travel as shared-memory handles that
    # die with the child; numpy arrays are pickled by value.
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  tol: float = 1e-6) -> None:  # fmt: skip
    for name, value in got.items():
        diff = (torch.as_tensor(value) - want[name]).abs().max().item()
        assert diff <= tol, f"{name}: max |delta| {diff:.3g}"


def _pipeline_rank(batch: int, chunks: int):
    rt = rw.get_runtime()
    pipe = rw.DistributedPipeline(_model(), chunks=chunks, balance=[3, 2])
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for x, y in _data(batch):
        # Each stage gets only what it needs: the input on the first, the target on the last.
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               nn.functional.mse_loss)  # fmt: skip
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # every stage returns the batch loss
    return rt.rank, _portable(pipe.state_dict()), losses


def test_two_rank_pipeline_equals_single_process_after_10_steps():
    # batch 10 in 4 micro-batches (3, 3, 2, 2): uneven on purpose.
    results = run_distributed(_pipeline_rank, 2, args=(10, 4), timeout=120)
    want, want_losses = _oracle(10)
    (rank0, sd0, l0), (rank1, sd1, l1) = results
    assert (rank0, rank1) == (0, 1)
    assert set(sd0) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(sd1) == {"4.weight", "4.bias"}
    _assert_close({**sd0, **sd1}, want)
    assert l0 == l1 and max(abs(a - b) for a, b in zip(l1, want_losses, strict=True)) <= 1e-6
    assert want_losses[-1] < want_losses[0]  # the oracle really trained


def _ddp_over_split_rank(per_rank: int, chunks: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    pipe = rw.split(_model(), devices=["cpu", "cpu"], balance=[2, 3], chunks=chunks)
    model = rw.DistributedDataParallel(
        pipe
    )  # device_ids=None: a module that may span several devices
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _data(per_rank * world):
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    return _portable(pipe.state_dict()), type(model).__module__


def test_ddp_over_two_replicas_of_a_two_stage_model_equals_oracle():
    results = run_distributed(_ddp_over_split_rank, 2, args=(3, 2), timeout=120)
    want, _ = _oracle(6)
    for state, _ in results:
        _assert_close(state, want)


def _pipeline_and_data_parallel_rank(per_replica: int, chunks: int):
    rank = dist.get_rank()
    replica, stage = divmod(rank, 2)  # pipelines [0, 1] and [2, 3]
    # Every rank creates every group, in the same order (torch's rule for new_group).
    dp_groups = [dist.new_group([s, s + 2]) for s in range(2)]
    pipe = rw.DistributedPipeline(
        _model(), ranks=[2 * replica, 2 * replica + 1], balance=[3, 2], chunks=chunks,
        data_parallel_group=dp_groups[stage],
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    for x, y in _data(2 * per_replica):
        mine = slice(replica * per_replica, (replica + 1) * per_replica)
        pipe.train_step(x[mine], y[mine], nn.functional.mse_loss)
        opt.step()
        opt.zero_grad()
    return _portable(pipe.state_dict())


@pytest.mark.slow  # 4 ranks: ~10 s alone, ~60 s on a loaded 2-core machine
def test_pipeline_with_data_parallel_groups_equals_oracle():
    results = run_distributed(_pipeline_and_data_parallel_rank, 4, args=(4, 2), timeout=120)
    want, _ = _oracle(8)
    for state in results:
        _assert_close(state, want)
    assert results[0].keys() == results[2].keys() and results[1].keys() == results[3].keys()


# -- mixed precision: bf16 activations and gradients cross the stages --------------------------


def _bf16_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def _bf16_oracle(batch: int, chunks: int) -> dict[str, torch.Tensor]:
    """The unsplit model under one bf16 autocast region, on the pipeline's own micro-batches
    (``tensor_split``: bf16 rounds differently for another split), each loss weighted by its
    share of the batch, gradients summed over the micro-batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _data(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for xi, yi in zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True):
                (_bf16_loss(model(xi), yi) * (xi.shape[0] / batch)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _bf16_pipeline_rank(batch: int, chunks: int, layout: tuple):
    schedule, per_rank, balance, first_on_rank_1 = layout
    pipe = rw.DistributedPipeline(_model(), chunks=chunks, balance=balance, schedule=schedule,
                                  stages_per_rank=per_rank)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    seen: set[torch.dtype] = set()
    if dist.get_rank() == 1:  # the dtype of what arrived from rank 0
        layer = dict(pipe.named_modules())[first_on_rank_1]
        layer.register_forward_pre_hook(lambda m, args: seen.add(args[0].dtype))
    for x, y in _data(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, _bf16_loss)
        opt.step()
        opt.zero_grad()
    return _portable(pipe.state_dict()), sorted(map(str, seen))


BF16_LAYOUTS = [  # (schedule, stages per rank, balance, rank 1's first layer)
    ("gpipe", 1, [3, 2], "3"), ("1f1b", 1, [3, 2], "3"), ("zero_bubble", 1, [3, 2], "3"),
    ("interleaved_1f1b", 2, [2, 1, 1, 1], "2"), ("zero_bubble", 2, [2, 1, 1, 1], "2"),
]  # fmt: skip


@pytest.mark.parametrize("layout", BF16_LAYOUTS, ids=lambda t: f"{t[0]}-v{t[1]}")
def test_a_bf16_autocast_pipeline_equals_one_process_bit_for_bit(layout):
    # batch 10 in 4 micro-batches (3, 3, 2, 2): the last shape differs, so the receive posted
    # for the old shape gets the filler first; every activation and gradient crosses in bf16
    # (two stages per rank: on streams of their own, tagged)
    results = run_distributed(_bf16_pipeline_rank, 2, args=(10, 4, layout), timeout=120)
    want = _bf16_oracle(10, 4)
    (sd0, _), (sd1, seen1) = results
    assert seen1 == ["torch.bfloat16"]
    for name, value in {**sd0, **sd1}.items():
        assert torch.equal(torch.as_tensor(value), want[name]), name


SIZES = (10, 10, 7, 3, 10, 10)
"""Batch sizes step after step, in 4 chunks: 3, 3, 2, 2 twice, then 2, 2, 2, 1 (an epoch's
shorter last batch), then 1, 1, 1 (fewer micro-batches than chunks), then 3, 3, 2, 2 again."""


def _varying_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(n, 5, generator=gen), torch.randn(n, 2, generator=gen)) for n in SIZES]


WIDE = 90_000
"""Activations of a wide model: 3 rows take 1.08 MB, above ``wire.PACK_MAX_BYTES`` (header and
tensor as two messages), 2 rows and 1 below it (one message): the sizes above cross it."""


WIDE_LR = 1e-4  # 0.1 on the wide model's sum over 90 000 features diverges


def _wide_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, WIDE), nn.Tanh(), nn.Linear(WIDE, 2))


def _varying_rank(schedule: str, v: int, wide: bool):
    model, balance = (_wide_model(), [2, 1]) if wide else (_model(), None)
    pipe = rw.DistributedPipeline(model, chunks=4, schedule=schedule, stages_per_rank=v,
                                  balance=balance)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=WIDE_LR if wide else LR)
    losses, evals = [], []
    for x, y in _varying_batches():
        losses.append(pipe.train_step(x, y, nn.functional.mse_loss).item())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation of another size between two steps
            out = pipe(x[:5])
        evals.append(None if out is None else out.numpy())
    return losses, evals, _portable(pipe.state_dict())


@pytest.mark.parametrize(("schedule", "v", "wide"),
                         [("1f1b", 1, False), ("interleaved_1f1b", 2, False), ("1f1b", 1, True)])  # fmt: skip
def test_batch_sizes_that_change_between_steps_and_evaluations_equal_one_process(schedule, v, wide):
    # Over Gloo the receive of each activation is posted shaped as the same micro-batch's
    # activation the last time; here those shapes change at every kind of step (uneven
    # micro-batches, a shorter batch, fewer micro-batches, evaluations of another size): each
    # change must arrive intact, two receives of a kind being out at once; wide, on both
    # sides of the size above which header and tensor travel apart.
    results = run_distributed(_varying_rank, 2, args=(schedule, v, wide), timeout=180)
    model = _wide_model() if wide else _model()
    opt = torch.optim.SGD(model.parameters(), lr=WIDE_LR if wide else LR)
    want_losses, want_evals = [], []
    for x, y in _varying_batches():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(loss.item())
        with torch.no_grad():
            want_evals.append(model(x[:5]))
    tol = 1e-5 if wide else 1e-6  # float32 sums over 90 000 features, cut by micro-batch
    state: dict = {}
    for losses, evals, sd in results:
        for a, b in zip(losses, want_losses, strict=True):
            assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)
        state.update(sd)
        for got, want in zip(evals, want_evals, strict=True):
            if got is not None:  # the last stage's rank returns the output
                assert (torch.as_tensor(got) - want).abs().max().item() <= tol
    assert sum(e is not None for _, evals, _ in results for e in evals) == len(SIZES)
    _assert_close(state, model.state_dict(), tol)
