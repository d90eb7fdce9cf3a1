"""An outsider who reaches the c10d rendezvous store cannot run code in ``rankwise run``.

torch's c10d rendezvous keeps its state as a base64 pickle under ``torch.rendezvous.<run id>``
in the agent's TCPStore (no authentication) and unpickles what it reads there. Each test
starts a real job on torch's c10d rendezvous (``--rdzv-id`` left at its default, ``none``),
waits until its worker runs, then writes, as an outsider would, a pickle to that key whose
unpickling would create a marker folder. Nothing may run; the job stops with an error naming
the forged key. Also: nodes that share ``--rdzv-token`` meet and finish; nodes given different
tokens do not meet, and say why; a job without a secret on a non-loopback address warns.
"""

from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from rankwise.launch.rendezvous import signed as signed_rdzv

KEY = "torch.rendezvous.none"
WORKER = textwrap.dedent("""
    import os, sys, time
    open(os.path.join(sys.argv[1], f"started{os.environ['GROUP_RANK']}"), "w").close()
    for _ in range(int(sys.argv[2]) * 10):  # short sleeps: a SIGTERM ends it at once
        time.sleep(0.1)
""")


class Payload:
    """Unpickling it creates ``path`` (what an outsider's code would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path, 0o777, True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp: Path, port: int, *flags: str, seconds: int = 60, env=None) -> subprocess.Popen:
    (tmp / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-timeout", "60", *flags, "worker.py", str(tmp), str(seconds)]  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for(path: Path, job: subprocess.Popen, timeout: float = 120) -> None:
    start = time.monotonic()
    while not path.exists():
        if job.poll() is not None or time.monotonic() - start > timeout:
            job.kill()
            _, err = job.communicate()
            pytest.fail(f"the job never started its worker:\n{err[-3000:]}")
        time.sleep(0.05)


def forge(port: int, marker: Path) -> None:
    """Write a malicious rendezvous state, as anyone who reaches the port could."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    store.set(KEY, base64.b64encode(pickle.dumps(Payload(str(marker)))).decode())


def _forged_and_stopped(tmp: Path, jobs: list[subprocess.Popen], port: int) -> list[str]:
    """Forge the state; every node must stop, name the key and run nothing. Every node, not only
    the first: the store's host may read the forgery first and leave, and a node that then finds
    the store closed cannot tell a forgery from the job's end (it went on to its end, exit 0)."""
    marker = tmp / "pwned"
    forge(port, marker)
    errs = []
    for node, job in enumerate(jobs):
        try:
            _, err = job.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            job.kill()
            _, err = job.communicate()
            pytest.fail(f"node {node} neither refused the forged state nor stopped:\n{err[-3000:]}")
        assert not marker.exists(), "the forged pickle ran in the launcher"
        assert job.returncode != 0, f"node {node}: {err[-3000:]}"
        assert repr(KEY) in err and "was not unpickled" in err, f"node {node}: {err[-3000:]}"
        errs.append(err)
    return errs


def test_a_forged_state_runs_nothing_and_stops_a_one_node_job_naming_the_key(tmp_path):
    port = _free_port()
    job = _job(tmp_path, port)  # one node: a secret generated for this job alone
    _wait_for(tmp_path / "started0", job)
    (err,) = _forged_and_stopped(tmp_path, [job], port)
    assert "not signed with this job's rendezvous secret" in err, err[-3000:]


@pytest.mark.slow  # two launchers
def test_nodes_sharing_a_token_meet_and_a_forged_state_is_refused(tmp_path):
    port = _free_port()
    nodes = [_job(tmp_path, port, "--nnodes", "2", env={"RANKWISE_RDZV_TOKEN": "s3cret"})
             for _ in range(2)]  # fmt: skip
    for rank in (0, 1):
        _wait_for(tmp_path / f"started{rank}", nodes[rank])
    for err in _forged_and_stopped(tmp_path, nodes, port):
        assert "not signed with this job's rendezvous secret" in err, err[-3000:]


@pytest.mark.slow  # two launchers
def test_nodes_sharing_a_token_finish(tmp_path):
    port = _free_port()
    nodes = [_job(tmp_path, port, "--nnodes", "2", "--rdzv-token", "s3cret", seconds=1)
             for _ in range(2)]  # fmt: skip
    for node in nodes:
        _, err = node.communicate(timeout=180)
        assert node.returncode == 0, err[-3000:]
        # a loopback endpoint with a secret: nothing to warn about (the launcher may still name
        # its native log, where torch's C++ side wrote its own warnings)
        assert "not signed" not in err and "rankwise run: warning" not in err, err[-3000:]


@pytest.mark.slow  # two launchers
def test_nodes_with_different_tokens_do_not_meet_and_say_why(tmp_path):
    port = _free_port()
    first = _job(tmp_path, port, "--nnodes", "2", "--rdzv-token", "one", seconds=1)
    _wait_for_store(port, first)
    second = _job(tmp_path, port, "--nnodes", "2", "--rdzv-token", "two", seconds=1)
    _, err = second.communicate(timeout=180)
    assert second.returncode != 0 and repr(KEY) in err, err[-3000:]
    assert "signature that does not match" in err or "not signed" in err, err[-3000:]
    # The node holding the store stops too (it waited for the whole --rdzv-timeout before).
    try:
        _, first_err = first.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        first.kill()
        first.communicate()
        pytest.fail("the node holding the store did not stop on the token mismatch")
    assert first.returncode != 0, first_err[-3000:]
    assert "different --rdzv-token" in first_err and repr(KEY) in first_err, first_err[-3000:]


def _wait_for_store(port: int, job: subprocess.Popen, timeout: float = 60) -> None:
    """Until the first node's store holds a rendezvous state (it has joined)."""
    from torch.distributed import TCPStore

    start = time.monotonic()
    while time.monotonic() - start < timeout and job.poll() is None:
        try:
            store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
            if store.check([KEY]) and store.get(KEY) != b"Y2FuaW1hZGFt":  # torch's empty state
                return
        except Exception:
            pass
        time.sleep(0.2)
    pytest.fail("the first node never joined its rendezvous")


@pytest.mark.slow  # two launchers
def test_without_a_token_a_forged_pickle_still_runs_nothing(tmp_path):
    """Several nodes and no secret (a warning, even on loopback): the restricted
    unpickler alone refuses the state, naming the pickled global."""
    port = _free_port()
    nodes = [_job(tmp_path, port, "--nnodes", "2") for _ in range(2)]
    for rank in (0, 1):
        _wait_for(tmp_path / f"started{rank}", nodes[rank])
    for err in _forged_and_stopped(tmp_path, nodes, port):
        assert "os.makedirs" in err or "posix.makedirs" in err, err[-3000:]


def test_the_warning_for_a_job_without_a_secret_on_any_address():
    for loopback in ("127.0.0.1:29400", "localhost:29400", "[::1]:29400"):
        # torch's store listens on every address: a loopback endpoint is no protection
        said = signed_rdzv.unsigned_warning(loopback)
        assert f"at {loopback} is not signed" in said and "every address of this machine" in said
        assert "RANKWISE_RDZV_TOKEN" in said
    text = signed_rdzv.unsigned_warning("10.0.0.1:29400")
    assert "10.0.0.1:29400" in text and "RANKWISE_RDZV_TOKEN" in text and "--rdzv-token" in text
    assert signed_rdzv.choose_secret("c10d", 2, None, b"new") is None  # so it warns
    assert signed_rdzv.choose_secret("c10d", 1, None, b"new") == b"new"
    assert signed_rdzv.choose_secret("c10d", 2, "tok", b"new") == b"tok"
    assert signed_rdzv.choose_secret("static", 2, "tok", b"new") is None


def test_a_c10d_job_without_a_secret_on_a_network_address_warns(tmp_path):
    """The launcher prints the warning before it tries the rendezvous (stopped then: the
    address is a documentation one that leads nowhere)."""
    (tmp_path / "worker.py").write_text("pass\n")
    cmd = [sys.executable, "-m", "rankwise", "run", "--nnodes", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "192.0.2.1:29400", "--rdzv-timeout", "5", "worker.py"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RANKWISE_RDZV_TOKEN"}
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in job.stderr:
            lines.append(line)
            if "Fix:" in line:
                break
    finally:
        job.kill()
        job.wait()
    text = "".join(lines)
    assert "warning: the c10d rendezvous at 192.0.2.1:29400 is not signed" in text, text
    assert "RANKWISE_RDZV_TOKEN" in text and "--rdzv-token" in text, text
