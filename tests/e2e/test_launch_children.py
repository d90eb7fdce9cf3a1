"""rw.launch's children die with their caller, end normally on sys.exit(0), and a signal that
kills one is named (SIGSEGV, not "exit code -11")."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

CALLER = textwrap.dedent(
    """
    import os, sys, time
    import rankwise as rw

    def train(folder):
        rt = rw.init()
        with open(os.path.join(folder, f"rank{rt.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        while True:  # training forever: only the caller's death may end it
            time.sleep(0.2)

    rw.launch(train, nprocs=2, args=(sys.argv[1],))
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not yet reaped by its new parent) has ended too
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def test_children_die_when_the_caller_is_killed(tmp_path):
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
        assert len(pids) == 2, "the ranks did not start"
        caller.send_signal(signal.SIGKILL)  # a notebook kernel killed
        caller.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        assert left == [], f"ranks {left} outlived their caller"
    finally:
        caller.kill()
        for p in tmp_path.glob("rank*.pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.read_text()), signal.SIGKILL)


ENDINGS = textwrap.dedent(
    """
    import os, signal, sys
    import rankwise as rw

    def exits():
        rt = rw.init()
        if rt.rank == 1:
            sys.exit(0)
        return "done"

    def crashes():
        rt = rw.init()
        if rt.rank == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        return "done"

    print("exit0", rw.launch(exits, nprocs=2, timeout=60))
    try:
        rw.launch(crashes, nprocs=2, timeout=60)
    except rw.DistributedError as exc:
        print("crash", str(exc).splitlines()[2])
    """
)


def test_sys_exit_0_is_a_normal_end_and_a_signal_is_named():
    out = subprocess.run(
        [sys.executable, "-c", ENDINGS], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "exit0 ['done', None]" in lines, out.stdout
    crash = "crash process was killed by signal 11 (SIGSEGV) before reporting"
    assert f"{crash}, while running the function" in lines, out.stdout  # and what it was doing
