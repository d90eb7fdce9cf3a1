"""The launcher's report names the rank that failed, and marks the ranks it stopped itself.

Rank 0 handles SIGTERM the way many programs do (it exits with its own code 1), so its exit
status alone looks like a failure: only the launcher knows it sent that SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        open("ready", "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists("succeeded") and time.monotonic() < deadline:
            time.sleep(0.05)  # until rank 1 succeeds (on a restart), or the launcher stops it
    else:
        while not os.path.exists("ready"):
            time.sleep(0.05)  # rank 0 runs, its SIGTERM handler set
        first = not os.path.exists("failed-once")
        open("failed-once", "w").close()
        if first or os.environ.get("FAIL_ALWAYS"):
            raise SystemExit(7)
        open("succeeded", "w").close()
""")
"""Rank 1 fails once rank 0 is running; on a restart it succeeds, and rank 0 ends with it. (A
restarted rank 0 could once write "ready" after a quick rank 1 had removed it, and then wait
out its 120 s deadline.)"""


def _run(tmp_path, *flags, env=None):
    (tmp_path / "job.py").write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", *flags, "job.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip


def test_a_rank_the_launcher_stopped_is_not_reported_as_failed(tmp_path):
    import os

    out = _run(tmp_path, env={**os.environ, "FAIL_ALWAYS": "1"})
    assert out.returncode == 7, out.stderr
    assert "rank(s) 1 failed (world size 2" in out.stderr, out.stderr
    assert "stopped by the launcher: rank(s) 0" in out.stderr
    assert "rank(s) 0, 1 failed" not in out.stderr and "rank(s) 1, 0 failed" not in out.stderr


def test_on_a_restart_only_the_failed_rank_is_named(tmp_path):
    out = _run(tmp_path, "--max-restarts", "1")
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("rankwise run:")]
    assert "rankwise run: rank 1 failed: exit code 7 (attempt 1 of 2)" in lines, out.stderr
    assert "rankwise run: stopped by the launcher: rank(s) 0" in lines
    assert not any("rank 0 failed" in ln for ln in lines), lines
    assert any("the job recovered after 1 restart(s)" in ln for ln in lines), lines


FIRST = textwrap.dedent("""
    import time, torch, rankwise as rw
    rt = rw.init(timeout=8)
    if rt.rank == 1:
        time.sleep(30)  # never reaches the job's first collective in time
    rw.all_reduce_sum(torch.ones(3))
""")


def test_a_rank_that_never_reached_the_first_collective_is_blamed(tmp_path):
    (tmp_path / "first.py").write_text(FIRST)
    out = subprocess.run(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "first.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert "rankwise run: rank(s) 1 never reached the collective that rank(s) 0 waited in" in (
        out.stderr
    ), out.stderr[-3000:]
    assert "rank 1 has not issued any collective yet, running user code at first.py:5" in out.stderr
    assert "stopped by the launcher: rank(s) 1" in out.stderr
