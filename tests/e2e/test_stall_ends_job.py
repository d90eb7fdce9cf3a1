"""A stall report ends the job (every process), unless ``RANKWISE_ON_STALL=wait`` asks to wait.

The reproduction: a rank stuck forever in a DataLoader worker was reported at 50 s, then the
job waited for the 300 s collective timeout. Here the timeout is 300 s and the report comes
after 3 s: a job that ends within the subprocess's bound ended on the report, not the timeout
(a liveness bound, not a timing claim; benchmarks/faults.py --matrix measures). The stuck
rank's DataLoader worker, stuck in ``__getitem__``, must die with it (no orphan).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .test_launcher_faults import alive

pytestmark = pytest.mark.slow

STUCK_LOADER = textwrap.dedent("""
    # Rank 1's DataLoader worker hangs in __getitem__ (it writes its pid first); rank 0 waits
    # in the next all-reduce.
    import os, sys, time, torch, rankwise as rw
    from torch.utils.data import DataLoader, Dataset

    class Stuck(Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            with open(f"worker{os.environ['RANK']}", "w") as f:
                f.write(str(os.getpid()))
            if os.environ["RANK"] == "1":
                time.sleep(3600)
            return torch.ones(1)

    rt = rw.init(timeout=float(sys.argv[1]))
    rw.all_reduce_sum(torch.ones(3))
    for x in DataLoader(Stuck(), batch_size=2, num_workers=1):
        rw.all_reduce_sum(x)
""")


def _run(tmp_path, timeout_s: float, bound: float, **env: str):
    (tmp_path / "stuck.py").write_text(STUCK_LOADER)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "stuck.py",
           str(timeout_s)]  # fmt: skip
    env = {**os.environ, "RANKWISE_STALL_REPORT_S": "3", **env}
    try:
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=bound,
                              env=env)  # fmt: skip
    finally:
        _kill_left(tmp_path)


def _kill_left(folder) -> list[int]:
    """Kill (and return) the DataLoader workers still alive: a failed test leaves none."""
    left = []
    for path in folder.glob("worker*"):
        with contextlib.suppress(ValueError, ProcessLookupError):
            pid = int(path.read_text())
            if alive(pid):
                left.append(pid)
                os.kill(pid, signal.SIGKILL)
    return left


def test_a_rank_stuck_in_a_loader_worker_is_reported_and_the_job_ends(tmp_path):
    # 300 s timeout, 150 s bound: ending at all means ending on the report.
    result = _run(tmp_path, 300, 150)
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    stall = err.index("[rank 0] stall: rank(s) 1 have not reached all_reduce")
    assert "rankwise ends the job now" in err[stall:]
    assert "Timed out waiting" not in err  # not the backend's timeout
    summary = err[err.rindex("rankwise run:") :]
    assert summary.startswith("rankwise run: rank(s) 1 never reached the collective"), summary
    assert "rank 0 raised" not in summary and "rank(s) 0 never" not in summary, summary


def test_the_loader_worker_of_an_ended_rank_is_not_left_behind(tmp_path):
    result = _run(tmp_path, 300, 150)
    assert result.returncode == 1, result.stderr[-3000:]
    deadline = time.monotonic() + 10  # SIGKILL from the kernel: a liveness bound
    pids = [int(p.read_text()) for p in tmp_path.glob("worker*") if p.read_text()]
    assert pids, "no DataLoader worker started"
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if alive(p)] == [], "a DataLoader worker outlived its rank"


def test_on_stall_wait_keeps_waiting_until_the_timeout(tmp_path):
    result = _run(tmp_path, 15, 150, RANKWISE_ON_STALL="wait")
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    stall = err.index("[rank 0] stall: rank(s) 1 have not reached all_reduce")
    assert "as RANKWISE_ON_STALL=wait asks; it fails at the timeout of 15s" in err[stall:]
    assert "Timed out waiting" in err[stall:] or "timed out" in err[stall:].lower(), err[-3000:]


LOADER_FOREVER = textwrap.dedent("""
    # Every rank's DataLoader worker hangs in __getitem__ after writing its pid.
    import os, time, torch
    from torch.utils.data import DataLoader, Dataset

    class Stuck(Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            with open(f"worker{os.environ['RANK']}", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)

    for x in DataLoader(Stuck(), batch_size=2, num_workers=1):
        pass
""")


def test_loader_workers_stuck_in_getitem_die_with_a_sigkilled_launcher(tmp_path):
    (tmp_path / "forever.py").write_text(LOADER_FOREVER)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "forever.py"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        files = [tmp_path / "worker0", tmp_path / "worker1"]
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline and launcher.poll() is None, "no loader worker"
            time.sleep(0.1)
        workers = [int(f.read_text()) for f in files]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10  # the kernel's SIGKILL, twice over: a liveness bound
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [w for w in workers if alive(w)] == [], "loader workers outlived the launcher"
    finally:
        launcher.kill()
        _kill_left(tmp_path)


MATRIX_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "matrix_train.py")


@pytest.mark.parametrize("strategy", ["mesh", "pipeline"])
def test_a_stuck_rank_beside_tensor_or_pipeline_peers_is_reported_and_the_job_ends(
    tmp_path, strategy
):
    """Their collectives were invisible to the stall report (tensor parallel's all-reduces;
    a pipeline stage's receive): the job waited for the timeout, then blamed the waiting rank.
    Timeout 300 s, bound 150 s: ending at all means ending on the report."""
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", MATRIX_SCRIPT,
           str(tmp_path), "--strategy", strategy, "--per-host", "2", "--fault", "stuck",
           "--victim", "1", "--at", "4", "--timeout", "300"]  # fmt: skip
    env = {**os.environ, "RANKWISE_STALL_REPORT_S": "3"}
    try:
        result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                                env=env)  # fmt: skip
    finally:
        for path in tmp_path.glob("loader*-*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(path.name.rsplit("-", 1)[1]), signal.SIGKILL)
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    assert "rankwise ends the job now" in err, err[-3000:]
    summary = err[err.rindex("rankwise run:") :]
    assert summary.startswith("rankwise run: rank(s) 1 never reached"), summary


MESH_STUCK = textwrap.dedent("""
    # A data 2 x tensor 2 mesh; rank 3 never comes back from its data (stuck). Its tensor
    # peer, rank 2, waits inside the forward's tensor-parallel all-reduce; ranks 0 and 1 wait
    # for rank 2 in the gradients' all-reduce. The cause is rank 3, not rank 2.
    import os, sys, time, torch, torch.nn.functional as F, rankwise as rw
    from torch import nn

    rt = rw.init(mesh={"data": 2, "tensor": 2}, timeout=300)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = rw.tensor_parallel(model, plan={"0": "column", "2": "row"},
                               group=rt.mesh.group("tensor"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.prepare(model, opt)
    for step in range(4):
        if step == 2 and rt.rank == 3:
            time.sleep(3600)  # stuck-site
        x = torch.randn(4, 4)
        rt.backward(F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)))
        opt.step()
        opt.zero_grad()
""")


def test_under_a_mesh_the_stuck_rank_is_named_not_its_waiting_tensor_peer(tmp_path):
    """The fault matrix's 3x2 mesh 'stuck' cell: the report named the tensor peer waiting for
    the stuck rank (rank 4), since the data group saw only that it never reached the
    gradients' all-reduce. A stall whose missing ranks all wait in another group's collective
    is left to that group's report."""
    (tmp_path / "mesh.py").write_text(MESH_STUCK)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "4", "mesh.py"]
    env = {**os.environ, "RANKWISE_STALL_REPORT_S": "3"}
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                            env=env)  # fmt: skip
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    assert "stall: rank(s) 3 have not reached all_reduce" in err, err[-3000:]
    assert "stall: rank(s) 2 have not reached" not in err, err[-3000:]
    assert "rank(s) 2 never reached" not in err, err[-3000:]
    assert "Timed out waiting" not in err
