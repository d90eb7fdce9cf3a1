"""``run_distributed`` under load: no wait on a thread start, and a timeout that says what it
waited for.

Was: each rank handed its result to a ``multiprocessing.Queue``, whose feeder thread the rank
starts on its first ``put``; under load average 12 that thread took 60 s to start, and a rank
that had finished read as a hang (1 of 864 runs of tests/dist/test_checkpoint_dist.py). Here
every thread start in the ranks is made slow on purpose, after the function ran: the results
must still come back, well within a timeout shorter than the delay.
"""

from __future__ import annotations

import threading
import time

import pytest

import rankwise as rw
from rankwise.testing import run_distributed

SLOW_START_S = 120.0


def _threads_start_slowly() -> int:
    start = threading.Thread.start

    def slow_start(self, *args, **kwargs):
        time.sleep(SLOW_START_S)  # what a machine at load average 12 did to a feeder thread
        return start(self, *args, **kwargs)

    threading.Thread.start = slow_start  # type: ignore[method-assign]
    return rw.get_runtime().rank


def test_results_come_back_however_slowly_threads_start():
    assert run_distributed(_threads_start_slowly, 2, timeout=60) == [0, 1]


def _rank1_never_returns() -> None:
    if rw.get_runtime().rank == 1:
        time.sleep(600)


def test_a_timeout_names_the_rank_and_what_it_was_doing():
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_rank1_never_returns, 2, timeout=45)
    text = str(info.value)
    assert text.startswith("run_distributed timed out on rank(s) 1 of 2"), text
    assert "rank 1 was running the function (for " in text
    assert "in _rank1_never_returns" in text  # its stack
    assert "(rank(s) 0 finished normally)" in text
