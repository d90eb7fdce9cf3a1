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
