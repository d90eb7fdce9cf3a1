"""run_distributed: results in rank order, a failing rank named, a hang turned into a failure."""

from __future__ import annotations

import time

import pytest

import rankwise as rw
from rankwise.testing import run_distributed


def _sum_of_ranks():
    rt = rw.get_runtime()
    return rt.rank, rw.all_reduce_sum(rt.rank + 1), rw.broadcast_object({"from": rt.rank})


def _rank1_raises():
    if rw.get_runtime().rank == 1:
        raise ValueError("boom on purpose")
    rw.barrier()


def _rank1_sleeps():
    if rw.get_runtime().rank == 1:
        time.sleep(600)
    rw.barrier(timeout=600)


def test_results_come_back_in_rank_order():
    assert run_distributed(_sum_of_ranks, 3) == [(r, 6, {"from": 0}) for r in range(3)]


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_rank1_raises, 2, timeout=30)
    text = str(info.value)
    assert "rank(s) 1" in text.splitlines()[0]
    assert "ValueError: boom on purpose" in text


def test_hang_becomes_failure_with_every_stack():
    start = time.monotonic()
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_rank1_sleeps, 2, timeout=20)
    assert time.monotonic() - start < 60
    text = str(info.value)
    assert "timed out" in text and "hang" in text
    assert "in _rank1_sleeps" in text  # rank 1's stack, taken while it slept
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text


def _what_the_rank_sees():
    import os
    import sys

    import torch

    print(f"printed by rank {os.environ['RANK']}")
    sys.stdout.flush()
    return (os.environ.get("RW_TEST_SET"), "RW_TEST_UNSET" in os.environ,
            torch.get_num_threads(), os.getppid() != 0)  # fmt: skip


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_both_start_methods_give_a_rank_the_callers_environment_and_output(
    start_method, monkeypatch, capfd
):
    """A forked rank's own environment and stdout are the fork server's, taken when the server
    started (an earlier test's): it must see this test's instead, as a spawned rank does."""
    monkeypatch.setenv("RW_TEST_UNSET", "then")
    with capfd.disabled():  # the server starts here (if no earlier test started it)
        run_distributed(_what_the_rank_sees, 2, start_method=start_method)
    monkeypatch.setenv("RW_TEST_SET", "now")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("RW_TEST_UNSET", raising=False)
    capfd.readouterr()
    values = run_distributed(_what_the_rank_sees, 2, start_method=start_method,
                             env={"OMP_NUM_THREADS": "2"})  # fmt: skip
    assert values == [("now", False, 2, True)] * 2
    out = capfd.readouterr().out
    assert "printed by rank 0" in out and "printed by rank 1" in out


def test_an_unknown_start_method_is_refused_by_name():
    with pytest.raises(ValueError, match=r"start_method='fork'.*'spawn'"):
        run_distributed(_sum_of_ranks, 2, start_method="fork")
