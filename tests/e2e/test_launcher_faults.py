"""The launcher under faults: SIGKILLed itself, workers that fail and are restarted."""

from __future__ import annotations

import os
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
                try:
                    os.kill(int(p.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
