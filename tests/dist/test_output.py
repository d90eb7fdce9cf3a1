"""Only rank 0 speaks by default; metric reduction equals the mean over ranks."""

from __future__ import annotations

import contextlib
import io
import logging

import rankwise as rw
from rankwise.testing import run_distributed


def _outputs(log_dir: str):
    rt = rw.get_runtime()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rw.print0("hello from print0")
        log = rw.get_logger("rankwise.test", log_dir=log_dir)
        log.info("routine message %d", rt.rank)
        log.warning("warning from %d", rt.rank)
        for _ in rw.progress(range(5), desc="train", mininterval=0):
            pass
    for h in logging.getLogger("rankwise.test").handlers:
        h.flush()
    return out.getvalue(), err.getvalue()


def test_only_rank_0_prints_logs_and_shows_a_bar(tmp_path):
    (out0, err0), (out1, err1) = run_distributed(_outputs, 2, args=(str(tmp_path),), timeout=60)
    # Not a terminal: the bar is whole lines on stdout, after the print it follows.
    assert out0.startswith("hello from print0\n") and out1 == ""
    assert "train" in out0 and "5/5" in out0 and "\r" not in out0
    assert "[rank 0/2] routine message 0" in err0
    # Rank 1: no bar, no routine log, but its warning still shows.
    assert err1 == "[rank 1/2] warning from 1\n"
    # The per-rank files hold everything each rank logged.
    assert "routine message 1" in (tmp_path / "rank1.log").read_text()
    assert "routine message 0" in (tmp_path / "rank0.log").read_text()


def _reduce(values):
    rank = rw.get_runtime().rank
    v = values[rank]
    return rw.all_reduce_mean(v), rw.all_reduce_sum(v), rw.all_reduce_max(v)


def test_metric_reduction_equals_mean_sum_max_over_ranks():
    values = [0.5, 2.25, -1.0]
    for mean, total, top in run_distributed(_reduce, 3, args=(values,), timeout=60):
        assert abs(mean - sum(values) / 3) < 1e-12
        assert abs(total - sum(values)) < 1e-12
        assert top == max(values)
