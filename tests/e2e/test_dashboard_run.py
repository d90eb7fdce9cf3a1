"""``rankwise run --dashboard``: the launcher serves the page while its workers run, and a hang's
diagnosis (the stall report) reaches the page and ``rankwise top`` before the job times out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

HANGING = textwrap.dedent("""
    # Rank 1 sleeps before the second all-reduce; rank 0 waits in it.
    import time, torch, rankwise as rw
    rt = rw.init(timeout=20)
    rw.all_reduce_sum(torch.ones(3))
    if rt.rank == 1:
        time.sleep(120)
    rw.all_reduce_sum(torch.ones(3))
""")


SLOW_DATA = Path(__file__).parent / "scripts" / "slow_data_train.py"


class Launched:
    """``rankwise run`` in the background, its stderr collected line by line."""

    def __init__(self, cwd: Path, args: list[str], env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankwise", "run", *args], cwd=cwd, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return found
            assert self.proc.poll() is None or self._reader.is_alive(), "".join(self.lines)
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{''.join(self.lines)}")

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(timeout=10)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def _poll_page(url: str, needle: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    html = ""
    while time.monotonic() < deadline:
        html = _get(url)
        if needle in html:
            return html
        time.sleep(0.5)
    raise AssertionError(f"{needle!r} not on the page within {timeout}s:\n{html[-2000:]}")


def test_run_serves_the_running_job_s_page_with_its_straggler(tmp_path) -> None:
    release = tmp_path / "release"
    job = Launched(tmp_path, ["--nproc-per-node", "2", "--dashboard", "--dashboard-port", "0",
                              "--profile-steps", "1", "--log-dir", "logs", str(SLOW_DATA),
                              str(release)], dict(os.environ))
    try:
        url = job.wait_for(r"dashboard at (http://127\.0\.0\.1:\d+/)").group(1)
        run = Path(tmp_path, job.wait_for(r"step timing in (\S+)").group(1))
        html = _poll_page(url, "straggler: rank 1 (node 0), input", timeout=150)
        assert "ddp &middot; 2 ranks" in html and html.count("<svg") == 4
        numbers = json.loads(_get(url + "summary.json"))
        assert [r["rank"] for r in numbers["ranks"]] == [0, 1]
        assert numbers["ranks"][0]["wait_for"] == 1  # rank 0 waits for the slow one
        assert numbers["ranks"][1]["phases"]["data"] > numbers["ranks"][0]["phases"]["data"]
        assert (run / "steps.jsonl").exists() and job.proc.poll() is None
    finally:
        release.touch()
        code = job.close()
    assert code == 0, "".join(job.lines)[-3000:]
    try:  # the page went with the launcher
        _get(url)
        raise AssertionError("the dashboard still answers after the job ended")
    except OSError:
        pass


def test_a_hang_reaches_the_page_before_the_timeout(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "hang.py").write_text(HANGING)
    env = {**os.environ, "RANKWISE_STALL_REPORT_S": "3", "RANKWISE_RUN_DIR": str(run)}
    job = Launched(tmp_path, ["--nproc-per-node", "2", "--dashboard", "--dashboard-port", "0",
                              "hang.py"], env)
    try:
        url = job.wait_for(r"dashboard at (http://127\.0\.0\.1:\d+/)").group(1)
        html = _poll_page(url, '<div class="banner hang"')
        assert "rank(s) 1 have not reached all_reduce #2" in html
        assert job.proc.poll() is None  # seen while the job still waits, not after it failed
        top = subprocess.run([sys.executable, "-m", "rankwise", "top", "--json", str(run)],
                             capture_output=True, text=True, timeout=60)
        assert "have not reached all_reduce #2" in json.loads(top.stdout)["hang"]["text"]
    finally:
        code = job.close()
    assert code == 1, "".join(job.lines)[-3000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["hang"] and events[0]["rank"] == 0


def test_rankwise_dashboard_serves_a_finished_run_until_ctrl_c(tmp_path) -> None:
    import signal

    from unit import dashboard_samples as ds

    run = ds.write_run(tmp_path / "run", steps=40)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "dashboard", str(run), "--dashboard-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as at a terminal: a pytest-xdist worker ignores SIGINT, and a child would
        # inherit that (Python then installs no KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()  # the URL first, flushed
        url = re.search(r"serving (http://127\.0\.0\.1:\d+/)", line).group(1)
        html = _get(url)
        assert "straggler: rank 2 (node 1), compute" in html and "step 40" in html
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
