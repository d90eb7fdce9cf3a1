"""Each failure is diagnosed by its cause (gloo, 2 ranks, through the public API).

- a rank that raises is named with its exception, never "finished normally" (also when it
  leaves through ``try: ... finally: rw.shutdown()``), in the survivor's diagnosis, in
  ``run_distributed``'s first line and as the exception ``rw.launch`` raises;
- uneven data (80 vs 48 samples, a plain DataLoader, DDP without join) gets the loader/join fix;
- per-rank batch sizes (the same collective, 32 vs 24 rows) get the prepared-loader fix;
- a collective entered through a context manager names the user's ``with`` line.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.diagnose import fingerprints as fp
from rankwise.testing import run_distributed

HERE = os.path.basename(__file__)


def _line(tag: str) -> int:
    with open(__file__) as f:
        return next(n for n, text in enumerate(f, 1) if text.rstrip().endswith(f"# {tag}"))


def _ddp_raises_at_step_5(raiser: int, finally_shutdown: bool) -> str:
    rt = rw.get_runtime()
    model = rw.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(20):
            if step == 5 and rt.rank == raiser:
                raise ValueError(f"bad batch at step {step}")  # raise-site
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        if finally_shutdown:
            rw.shutdown()  # reached while the ValueError propagates: no normal end
    return "finished"


@pytest.mark.parametrize(("raiser", "finally_shutdown"), [(0, False), (1, True)])
def test_the_survivor_names_the_rank_that_raised(raiser, finally_shutdown):
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_ddp_raises_at_step_5, 2, args=(raiser, finally_shutdown), timeout=90)
    text = str(info.value)
    first = text.splitlines()[0]
    assert f"rank {raiser} raised ValueError: bad batch at step 5" in first, first
    assert f"rank(s) {1 - raiser} failed waiting for it" in first, text
    survivor = text[text.index(f"--- rank {1 - raiser} ---") :]
    assert (
        f"rank {raiser} raised ValueError: bad batch at step 5 at {HERE}:{_line('raise-site')}"
    ) in survivor
    assert f"Rank {raiser}'s exception is the cause" in survivor
    assert "finished normally" not in text and "if rank == 0" not in text
    assert "GLHF" not in text and "The above exception was the direct cause" not in text


def test_rw_launch_raises_the_exception_of_the_rank_that_raised():
    with pytest.raises(ValueError, match="bad batch at step 5") as info:
        rw.launch(_launched, nprocs=2, timeout=90)
    assert info.value.rank == 1


def _launched() -> str:
    rw.init("gloo", timeout=30)
    return _ddp_raises_at_step_5(1, False)


def _uneven(after: str) -> None:
    rt = rw.get_runtime()
    n = 80 if rt.rank == 0 else 48  # 10 batches of 8 on rank 0, 6 on rank 1
    loader = DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 2)), batch_size=8)
    model = rw.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.zeros(())
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    if after == "mean":
        rw.all_reduce_mean(loss)  # after-loop-site


@pytest.mark.parametrize("after", ["end", "mean"])
def test_uneven_data_gets_the_loader_or_join_fix(after):
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_uneven, 2, args=(after,), timeout=90)
    text = str(info.value)
    assert (
        "Uneven data: rank(s) 1 stopped training (their batches ran out, or they left the loop) "
        "while rank(s) 0 are still training"
    ) in text, text
    assert "Fix: every rank must run the same number of training steps" in text
    assert "rw.loader(" in text and "model.join()" in text
    assert "`if rank == 0:`" not in text


def _batch_sizes() -> None:
    rt = rw.get_runtime()
    losses = torch.ones(32 if rt.rank == 0 else 24)  # one loss per sample
    rw.all_reduce_sum(losses)


def test_per_rank_batch_sizes_get_the_prepared_loader_fix():
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_batch_sizes, 2, timeout=90)
    text = str(info.value)
    assert "differ only in their first dimension (32 on rank 0, 24 on rank 1)" in text, text
    assert "Fix: every rank must use batches of the same size" in text
    assert "rw.gather_for_metrics" in text and "`if rank == 0:`" not in text


def _through_a_with_block() -> None:
    rt = rw.init("gloo", timeout=30)
    fp.configure(check_every=1)
    if rt.rank == 0:
        rw.all_reduce_sum(torch.ones(2))  # plain-site
    else:
        with rt.rank_zero_first():  # with-site
            pass


def test_a_collective_entered_through_a_with_block_names_the_users_line():
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_through_a_with_block, 2, init=False, timeout=90)
    text = str(info.value)
    assert f"rank 1 calls barrier #1 (from {HERE}:{_line('with-site')}" in text, text
    assert f"rank 0 calls all_reduce #1 (sum, float32[2], from {HERE}:{_line('plain-site')}" in (
        text
    )
    assert "contextlib.py" not in text
