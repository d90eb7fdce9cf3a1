"""`rankwise run` and `python -m rankwise.launch` as a user runs them: real processes, real ports.

Every launcher runs as `python -m rankwise ...` in a subprocess with a timeout, so a hang is a
failure, never a stuck suite.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPORT_ENV = textwrap.dedent("""
    # Writes this worker's environment and the result of an all_reduce to OUT/rank<R>.json.
    import json, os, sys
    import rankwise as rw
    rt = rw.init()
    total = rw.all_reduce_sum(rt.rank + 1)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"]
    report = {k: os.environ.get(k) for k in keys}
    report.update(sum=total, argv=sys.argv[1:], backend=rt.backend)
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{rt.rank}.json"), "w") as f:
        json.dump(report, f)
    print(f"hello from rank {rt.rank}")
    rw.shutdown()
""")

FAILING = textwrap.dedent("""
    # Rank 1 fails (raises or is SIGKILLed); rank 0 would sleep for two minutes.
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    with open(f"pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(0.5)
        if sys.argv[1] == "raise":
            def load_batch(i):
                raise ValueError(f"corrupt batch {i}")
            load_batch(7)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
""")

LEGACY = textwrap.dedent("""
    # A torch.distributed.launch-era script: its device comes from --local_rank.
    import argparse, os
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, required=True)
    p.add_argument("--epochs", type=int)
    a = p.parse_args()
    print(f"local_rank={a.local_rank} env={os.environ['LOCAL_RANK']} epochs={a.epochs}")
""")


def rankwise(*args: str, cwd: Path, timeout: float = 120, module: str = "rankwise"):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def start(*args: str, cwd: Path, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "rankwise", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"launcher did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def reports(folder: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in folder.glob("rank*.json")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent has not collected it yet


@pytest.fixture
def job(tmp_path: Path) -> Path:
    (tmp_path / "report_env.py").write_text(REPORT_ENV)
    (tmp_path / "failing.py").write_text(FAILING)
    (tmp_path / "legacy.py").write_text(LEGACY)
    return tmp_path


def test_two_jobs_at_once_each_report_their_env(job: Path):
    # Two single-node jobs started together: each picks its own free port (no EADDRINUSE).
    outs = [job / "a", job / "b"]
    procs = []
    for out in outs:
        out.mkdir()
        procs.append(start("run", "--nproc-per-node", "2", "report_env.py", str(out), cwd=job))
    ports = []
    for proc, out in zip(procs, outs, strict=True):
        code, stdout, stderr = finish(proc)
        assert code == 0, stderr
        rep = reports(out)
        assert sorted(rep) == [0, 1]
        for rank, r in rep.items():
            assert (r["RANK"], r["LOCAL_RANK"]) == (str(rank), str(rank))
            assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_RANK"]) == ("2", "2", "0")
            assert r["sum"] == 1 + 2 and r["argv"] == [str(out)] and r["backend"] == "gloo"
        assert rep[0]["MASTER_PORT"] == rep[1]["MASTER_PORT"]
        ports.append(rep[0]["MASTER_PORT"])
        # Output is rank-prefixed by default.
        assert "[rank0]: hello from rank 0" in stdout and "[rank1]: hello from rank 1" in stdout
    assert ports[0] != ports[1]


def test_two_nodes_on_one_machine_give_world_4(job: Path):
    port = str(free_port())
    common = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", port, "--rdzv-timeout", "100"]  # fmt: skip
    out = job / "out"
    out.mkdir()
    node1 = start(*common, "--node-rank", "1", "report_env.py", str(out), cwd=job)
    node0 = start(*common, "--node-rank", "0", "report_env.py", str(out), cwd=job)
    for proc in (node0, node1):
        code, _, stderr = finish(proc)
        assert code == 0, stderr
    rep = reports(out)
    assert sorted(rep) == [0, 1, 2, 3]
    for rank, r in rep.items():
        node, local = int(r["GROUP_RANK"]), int(r["LOCAL_RANK"])
        assert rank == node * 2 + local  # node 0 holds ranks 0-1, node 1 ranks 2-3
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["MASTER_PORT"]) == ("4", "2", port)
        assert r["sum"] == 1 + 2 + 3 + 4


FAILURES = {"raise": (1, "exit code 1"), "kill": (128 + 9, "signal 9 (SIGKILL)")}


def test_a_failing_rank_stops_all_and_is_named(job: Path):
    # Both jobs at once (each in its own folder) to save wall time; each fails on rank 1.
    begin = time.monotonic()
    procs = {}
    for mode in FAILURES:
        (job / mode).mkdir()
        (job / mode / "failing.py").write_text(FAILING)
        procs[mode] = start("run", "--nproc-per-node", "2", "failing.py", mode, cwd=job / mode)
    for mode, (code, cause) in FAILURES.items():
        folder = job / mode
        returncode, _, stderr = finish(procs[mode])
        assert returncode == code, stderr
        headline = {"raise": "rank 1 raised ValueError: corrupt batch 7 (world size 2, node 0)",
                    "kill": "rank(s) 1 failed (world size 2, node 0)"}[mode]  # fmt: skip
        assert f"rankwise run: {headline}" in stderr, stderr
        assert f"rank 1 (local_rank 1, pid {(folder / 'pid1').read_text()}): {cause}" in stderr
        assert "stopped by the launcher: rank(s) 0" in stderr
        if mode == "raise":
            # The last traceback lines, from the user's own code.
            assert "    ValueError: corrupt batch 7" in stderr
            assert 'failing.py", line 11, in load_batch' in stderr
        assert not alive(int((folder / "pid0").read_text()))
    assert time.monotonic() - begin < 90  # rank 0 would have slept 120 s: it was stopped


def test_sigterm_stops_every_worker(job: Path):
    proc = start("run", "--nproc-per-node", "2", "failing.py", "sleep", cwd=job)
    deadline = time.monotonic() + 90
    while not all((job / f"pid{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
        time.sleep(0.2)
    pids = [int((job / f"pid{r}").read_text()) for r in (0, 1)]
    proc.send_signal(signal.SIGTERM)
    code, _, stderr = finish(proc, timeout=60)
    assert code == 128 + signal.SIGTERM
    assert "received SIGTERM; stopped all 2 worker(s) of this node" in stderr
    time.sleep(0.5)
    assert not any(alive(p) for p in pids)


def test_legacy_launcher_passes_local_rank(job: Path):
    result = rankwise("--nproc_per_node=2", "legacy.py", "--epochs", "3", cwd=job,
                      module="rankwise.launch")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[rank0]: local_rank=0 env=0 epochs=3" in result.stdout
    assert "[rank1]: local_rank=1 env=1 epochs=3" in result.stdout


BAD_INPUT = [
    (["--nproc-per-node", "0", "legacy.py"], "--nproc-per-node: nproc-per-node = 0 is not at least 1"),
    (["--nnodes", "2", "--node-rank", "2", "legacy.py"],
     "--node-rank=2 is out of range for --nnodes=2"),
    (["missing.py"], "training script 'missing.py' not found"),
]  # fmt: skip


def test_bad_input_and_unreachable_master_give_clear_errors(job: Path):
    # All at once to save wall time: each is a separate launcher.
    port = str(free_port())  # nobody listens there
    unreachable = start("run", "--nnodes", "2", "--node-rank", "1", "--master-port", port,
                        "--rdzv-timeout", "3", "--log-dir", str(job / "logs"), "report_env.py",
                        str(job), cwd=job)  # fmt: skip
    bad = [start("run", *args, cwd=job) for args, _ in BAD_INPUT]
    begin = time.monotonic()
    for proc, (_, message) in zip(bad, BAD_INPUT, strict=True):
        code, _, stderr = finish(proc, timeout=60)
        assert code == 2
        assert f"rankwise run: error: {message}" in stderr
        assert "Fix: " in stderr and "Traceback" not in stderr
    code, _, stderr = finish(unreachable, timeout=60)
    assert code == 1
    assert (
        f"node 1 of 2 could not complete the static rendezvous at 127.0.0.1:{port} "
        "within --rdzv-timeout=3s"
    ) in stderr
    assert "Fix: start node 0 first" in stderr
    # torch's retry warnings and C++ frames went to the log the message names (native_log.py).
    assert "frame #" not in stderr, stderr
    assert f"is kept in {job / 'logs'}" in stderr
    assert time.monotonic() - begin < 60  # not a hang: the 3 s timeout plus start-up


MISMATCHED = textwrap.dedent("""
    # Rank 0 waits in a barrier that rank 1 never reaches (rank 1 all-reduces instead).
    import torch, rankwise as rw
    from rankwise.diagnose import fingerprints
    rt = rw.init(timeout=5)
    fingerprints.configure(checks=False)  # let the hang happen, then be explained
    if rt.rank == 0:
        rw.barrier()
    rw.all_reduce_sum(torch.ones(3))
""")


def test_launcher_summary_carries_the_hang_diagnosis(job: Path):
    (job / "mismatched.py").write_text(MISMATCHED)
    result = rankwise("run", "--nproc-per-node", "2", "mismatched.py", cwd=job)
    assert result.returncode != 0
    summary = result.stderr[result.stderr.index("rankwise run:") :]
    assert "  diagnosis:" in summary
    assert "rank 0 is waiting in barrier #1 (from mismatched.py:8, inside `if rt.rank == 0`)" in (
        summary
    )
    assert "rank 1 is waiting in all_reduce #1 (sum, float32[3], from mismatched.py:9)" in summary
