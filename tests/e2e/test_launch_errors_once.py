"""`rankwise run` says a worker's error once (issue 43): `strategy="zer03"` under 2 processes
printed the same traceback on every rank and again in the summary, with no "did you mean"; a
syntax error was found only after the workers had started."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rankwise.launch.failures.report import RankFailure, summarize
from rankwise.strategies import closest, unknown

ZER03 = 'import rankwise as rw\nrt = rw.init(strategy="zer03")\nrt.print("never")\n'
SYNTAX = 'import rankwise as rw\nrt = rw.init()\nif rt.rank == 0\n    print("x")\n'


def _run(folder, source: str, nproc: int = 2) -> subprocess.CompletedProcess:
    (folder / "train.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "rankwise", "run", "--nproc-per-node",
                           str(nproc), "train.py"], cwd=folder, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_misspelt_strategy_is_said_once_with_did_you_mean(tmp_path, nproc):
    proc = _run(tmp_path, ZER03, nproc)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count("did you mean 'zero3'?") == 1, out
    assert out.count('rt = rw.init(strategy="zer03")') == 1, out  # the user's line, once
    assert len(out.splitlines()) <= 22, out  # was ~47 lines
    assert "never" not in proc.stdout


def test_a_syntax_error_is_reported_once_before_any_worker_starts(tmp_path):
    begin = time.monotonic()
    proc = _run(tmp_path, SYNTAX)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count("SyntaxError") == 1, out
    assert "train.py:3" in out and "if rt.rank == 0" in out and "no worker was started" in out
    assert "[rank" not in out  # no worker printed anything: none started
    assert time.monotonic() - begin < 120  # a liveness bound, not a speed claim


@pytest.mark.parametrize(("typed", "meant"), [("zer03", "zero3"), ("ZeRO-3", "zero3"),
                                              ("zero_2", "zero2"), ("DDP", "ddp"), ("dpp", "dp")])
def test_a_misspelt_strategy_names_the_closest_one(typed, meant):
    assert closest(typed) == meant
    assert f"did you mean {meant!r}?" in unknown(typed).fix


def test_no_guess_for_a_word_far_from_every_strategy():
    assert closest("banana") is None and "did you mean" not in unknown("banana").fix


def _failure(rank: int, error: str) -> RankFailure:
    tb = f'Traceback (most recent call last):\n  File "train.py", line 2, in <module>\n    x()\n{error}\n'
    return RankFailure(rank=rank, local_rank=rank, pid=100 + rank, exitcode=1, traceback=tb)


def test_the_summary_quotes_an_error_that_every_rank_raised_once():
    same = "rankwise.errors.ConfigError: strategy='zer03' is bad\nFix: did you mean 'zero3'?"
    text, _ = summarize([_failure(0, same), _failure(1, same), _failure(2, "ValueError: other")],
                        world_size=3, node_rank=0, raisers=[(0, "ConfigError: ...")])  # fmt: skip
    assert text.count("did you mean 'zero3'?") == 1
    assert "raised the same error as rank 0" in text
    assert "ValueError: other" in text  # a different error is shown in full
    assert text.count('File "train.py", line 2') == 2  # rank 0's and rank 2's, not rank 1's
