"""rt.print / rt.log say when the number rank 0 prints is not the other ranks' (issue 43:
accuracy from ``.item()`` on each rank; a sum printed after all_reduce; a print on rank 0 only)."""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch
import torch.distributed as dist

import rankwise as rw
from rankwise.testing import run_distributed


def _captured(fn, *args):
    """What ``fn`` prints, and what rw.shutdown() then adds (a note that came late: a loaded
    machine may bring a rank's numbers after rank 0's wait)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        fn(*args)
        rw.barrier()
        rw.shutdown()
    return out.getvalue(), err.getvalue()


def _accuracy_per_rank(correct_per_rank):
    rt = rw.init()
    # Each rank's own shard: `correct` of 4 predictions right, counted with .item().
    pred = torch.tensor([1, 1, 1, 1])
    target = torch.tensor([1] * correct_per_rank[rt.rank] + [0] * (4 - correct_per_rank[rt.rank]))
    acc = (pred == target).float().mean().item()
    return _captured(lambda: rt.print(f"epoch 0 accuracy {acc:.3f}"))


@pytest.mark.parametrize("world", [2, 3])
def test_accuracy_from_item_on_each_rank_says_ranks_differ_and_the_mean(world):
    correct = [4, 0, 2][:world]
    results = run_distributed(_accuracy_per_rank, world, args=(correct,), timeout=90)
    mean = sum(c / 4 for c in correct) / world
    out0 = results[0][0] + results[0][1]
    assert "epoch 0 accuracy 1.000" in out0  # rank 0's own value is still what it printed
    assert "rank 0's value; ranks differ" in out0
    assert f"mean {mean:.3f}" in out0
    assert all(r[0] == "" for r in results[1:])  # only rank 0 speaks


def _same_everywhere():
    rt = rw.init()
    acc = torch.tensor([1.0 if rt.rank == 0 else 0.0])
    dist.all_reduce(acc)  # the sum over ranks: the same number on every rank
    return _captured(lambda: rt.print(f"accuracy {acc.item():.3f}"))


def test_a_value_reduced_before_the_print_is_printed_without_a_note():
    (out0, err0), (out1, _) = run_distributed(_same_everywhere, 2, timeout=90)
    # The sum (1.000) is what every rank holds: the line is not rank 0's alone, so no note.
    assert out0 == "accuracy 1.000\n" and out1 == ""
    assert "differ" not in err0


def _rank0_only():
    rt = rw.init()
    t0 = time.monotonic()
    # The print is no collective: both ranks reach the barrier in _captured.
    got = _captured(lambda: [rt.print(f"loss {i / 7:.4f}") for i in range(3) if rt.rank == 0])
    return got, time.monotonic() - t0


def test_a_print_on_rank_0_alone_does_not_hang_and_adds_nothing():
    ((out0, err0), took0), _ = run_distributed(_rank0_only, 2, timeout=90)
    assert out0 == "loss 0.0000\nloss 0.1429\nloss 0.2857\n"
    assert "differ" not in err0
    assert took0 < 30  # a liveness bound: rank 0 waited once, briefly, not per line


def _late_peer():
    rt = rw.init()
    if rt.rank == 1:
        time.sleep(3.0)  # rank 1 reaches the print long after rank 0 printed
    value = 10 + rt.rank * 10
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rt.print(f"seen {value}")
        rw.barrier()
        rw.shutdown()  # rank 0 compares the values that came after its line
    return out.getvalue()


def test_values_that_arrive_after_the_line_are_compared_at_shutdown():
    out0, _ = run_distributed(_late_peer, 2, timeout=90)
    assert out0.startswith("seen 10")
    assert "'seen 10' printed earlier" in out0 and "mean 15" in out0


def _logged(log_dir, reduce):
    rt = rw.init()
    rt.log_to(log_dir, log_with=["csv"])
    acc = [1.0, 0.5][rt.rank]
    return _captured(lambda: rt.log({"acc": acc, "step_time": 0.25}, step=3, reduce=reduce))


def test_rt_log_of_an_unreduced_metric_names_it_and_the_fix(tmp_path):
    (_, err0), (_, err1) = run_distributed(_logged, 2, args=(str(tmp_path), None), timeout=90)
    assert "acc=1.0 is rank 0's value; ranks differ: mean 0.75" in err0
    assert "step_time" not in err0  # equal on every rank: not flagged
    assert "reduce='mean'" in err0 and err1 == ""
    (_, err0), _ = run_distributed(_logged, 2, args=(str(tmp_path / "r"), "mean"), timeout=90)
    assert "differ" not in err0
