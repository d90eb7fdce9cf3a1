"""``rw.shutdown(); rw.init()`` three times over, under every rendezvous ``rankwise run`` has.

Was: under c10d across hosts (rank 0 hosts the store; the agent's is not shared) the second
``rw.init`` met the first group's keys in the store and hung, then the summary blamed the
user's code ("rank 1 ... finished normally without it"). Here every rendezvous: one node on a
free port, static on a fixed port (the agent's store), c10d on loopback (the agent's store),
c10d on this machine's other address (a fresh store per round, hosted by rank 0: the case of
a job across hosts). Each init sums over the world, so a group that met the wrong peers fails.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from rankwise.job import netif

pytestmark = pytest.mark.slow

REINIT = textwrap.dedent("""
    import torch, rankwise as rw
    for i in range(3):
        rw.init(timeout=30)
        print(f"init {i}: {rw.all_reduce_sum(torch.ones(1)).item():.0f}", flush=True)
        rw.shutdown()
""")


def _free_port(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return str(s.getsockname()[1])


def _outside_address() -> str | None:
    """This machine's address towards the outside (not loopback), or None."""
    found = netif.source_address_towards("192.0.2.1")  # TEST-NET-1: never contacted (UDP)
    return None if found is None or netif.is_loopback(found) else found


def _flags(kind: str) -> list[str]:
    if kind == "one node":
        return []
    if kind == "static":
        return ["--master-port", _free_port()]
    if kind == "c10d loopback":
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    addr = _outside_address()
    if addr is None:
        pytest.skip("this machine has no address besides loopback")
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{_free_port(addr)}"]


@pytest.mark.parametrize("kind", ["one node", "static", "c10d loopback", "c10d other address"])
def test_shutdown_then_init_three_times(tmp_path, kind):
    (tmp_path / "reinit.py").write_text(REINIT)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", *_flags(kind),
           "reinit.py"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        for i in range(3):
            assert f"[rank{rank}]: init {i}: 2" in result.stdout, result.stdout[-2000:]
    assert "finished normally" not in result.stderr  # no blame on the user's code
