"""The launcher under faults: SIGKILLed itself, workers that fail and are restarted."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

LOOPING = textwrap.dedent("""
    # Each rank records its pid, then keeps "training" for two minutes.
    import os, time
    with open(f"pid{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(paths: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text() for p in paths):
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)


def test_workers_die_with_a_sigkilled_launcher(tmp_path):
    (tmp_path / "loop.py").write_text(LOOPING)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "loop.py"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pids = [tmp_path / "pid0", tmp_path / "pid1"]
    try:
        _wait_for(pids, 90)
        workers = [int(p.read_text()) for p in pids]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [w for w in workers if alive(w)]
        assert survivors == [], f"workers {survivors} outlived their launcher"
    finally:
        launcher.kill()
        for p in pids:
            if p.exists() and p.read_text():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p.read_text()), signal.SIGKILL)


FLAKY = textwrap.dedent("""
    # Rank 1 fails on the first attempts (argv[1] of them), then everyone succeeds.
    import os, sys
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if os.environ["RANK"] == "1" and attempt < int(sys.argv[1]):
        raise ValueError(f"flaky on attempt {attempt}")
""")


def _run_flaky(tmp_path: Path, failing_attempts: int, max_restarts: int):
    (tmp_path / "flaky.py").write_text(FLAKY)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), "flaky.py", str(failing_attempts)]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_each_failure_and_restart_is_reported_and_recovery_summarised(tmp_path):
    result = _run_flaky(tmp_path, failing_attempts=2, max_restarts=3)
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    for attempt in (0, 1):
        assert (
            f"rankwise run: rank 1 failed: exit code 1 (ValueError: flaky on attempt {attempt}) "
            f"(attempt {attempt + 1} of 4)"
        ) in err, err
    assert "rankwise run: restarting all workers (restart 1 of 3)" in err
    assert "rankwise run: restarting all workers (restart 2 of 3)" in err
    assert "restart 3 of 3" not in err
    assert "rankwise run: the job recovered after 2 restart(s) (of --max-restarts=3)" in err


def test_running_out_of_restarts_says_so(tmp_path):
    result = _run_flaky(tmp_path, failing_attempts=5, max_restarts=1)
    assert result.returncode == 1
    assert "(attempt 2 of 2)" in result.stderr
    assert "no restart left (all 1 used): the job fails" in result.stderr
    assert "recovered" not in result.stderr


STOPPED_WHEN_ONE_FAILS = textwrap.dedent("""
    # Rank 1 stops itself (SIGSTOP); once it is stopped, rank 0 fails and the launcher ends it.
    import os, signal, sys, time
    rank = os.environ["RANK"]
    if rank == "1":
        def on_term(*_):
            open("rank1-got-sigterm", "w").close()
            sys.exit(143)
        signal.signal(signal.SIGTERM, on_term)
        open("pid1", "w").write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        # Short sleeps: CPython runs a handler in the main thread, and a SIGTERM the kernel
        # hands to another thread does not cut a long sleep short.
        for _ in range(1200):
            time.sleep(0.1)
    else:
        while not (os.path.exists("pid1") and open("pid1").read()):
            time.sleep(0.05)
        stat = f"/proc/{open('pid1').read()}/stat"
        while open(stat).read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.05)
        raise ValueError("rank 0 fails while rank 1 is stopped")
""")


def test_a_stopped_rank_is_resumed_to_receive_the_launchers_sigterm(tmp_path):
    """torch's agent sends SIGTERM and waits 30 s before SIGKILL; a SIGSTOPped rank only gets
    the SIGTERM once continued, so the launcher continues it: its handler runs."""
    (tmp_path / "stopped.py").write_text(STOPPED_WHEN_ONE_FAILS)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "stopped.py"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    err = result.stderr
    assert result.returncode == 1, err
    assert (tmp_path / "rank1-got-sigterm").exists(), err[-3000:]
    assert "ValueError: rank 0 fails while rank 1 is stopped" in err
    assert "stopped by the launcher: rank(s) 1" in err, err[-3000:]


HANGING = textwrap.dedent("""
    # Rank 1 sleeps before the second all-reduce; rank 0 waits in it.
    import time, torch, rankwise as rw
    rt = rw.init(timeout=15)
    rw.all_reduce_sum(torch.ones(3))
    if rt.rank == 1:
        time.sleep(120)
    rw.all_reduce_sum(torch.ones(3))
""")


def test_a_hang_is_reported_early_and_blamed_on_the_missing_rank(tmp_path):
    (tmp_path / "hang.py").write_text(HANGING)
    # wait: the report leaves the job waiting for its timeout (test_stall_ends_job: the default)
    env = {**os.environ, "RANKWISE_STALL_REPORT_S": "3", "RANKWISE_ON_STALL": "wait"}
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "hang.py"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    err = result.stderr
    assert result.returncode == 1, err
    stall = err.index("[rank 0] stall: rank(s) 1 have not reached all_reduce #2")
    assert stall < err.index("Timed out waiting"), "the stall report came after the timeout"
    assert "rank 1 has not reached #2: it finished all_reduce #1" in err
    assert "running user code at hang.py:7" in err[stall:]
    summary = err[err.index("rankwise run:") :]
    assert summary.startswith("rankwise run: rank(s) 1 never reached the collective that rank(s) 0")
    assert summary.count("Rank(s) 1 never reached #2.") == 1, summary
    assert "Fix: look at where rank(s) 1 were" in summary


RAW_MISMATCH = textwrap.dedent("""
    import torch, torch.distributed as dist, rankwise as rw
    rt = rw.init(timeout=60)
    x = torch.ones(4)
    dist.all_reduce(x) if rt.rank == 0 else dist.broadcast(x, src=0)
""")


def test_run_debug_turns_on_torch_collective_checks(tmp_path):
    (tmp_path / "raw.py").write_text(RAW_MISMATCH)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "--debug", "raw.py"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Detected mismatch between collectives on ranks" in result.stderr
    # whichever rank checks first names its own op first: both orders are right
    assert re.search(r"Op type: (ALLREDUCE ?vs BROADCAST|BROADCAST ?vs ALLREDUCE)", result.stderr)


REINIT = textwrap.dedent("""
    import torch, rankwise as rw
    rw.init(timeout=20)
    rw.all_reduce_sum(torch.ones(1))
    rw.shutdown()  # what init's own error recommends before init with other settings
    rw.init(timeout=15)
    print(f"after re-init: {rw.all_reduce_sum(torch.ones(1)).item():.0f}")
""")


def test_shutdown_then_init_works_under_the_launcher(tmp_path):
    import socket

    (tmp_path / "reinit.py").write_text(REINIT)
    with socket.socket() as s:  # a fixed port: the static rendezvous, whose store outlives groups
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "--master-port",
           port, "reinit.py"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[rank0]: after re-init: 2" in result.stdout and "[rank1]: after re-init: 2" in result.stdout
