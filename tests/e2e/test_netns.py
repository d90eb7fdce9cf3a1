"""Two network namespaces as two hosts: node 0 at 10.231.77.1, node 1 at 10.231.77.2.

Each namespace has only its loopback and one end of a veth pair, and the hostname resolves to
127.0.0.1 there, as in many containers: without the interface choice (GLOO_SOCKET_IFNAME
towards the master) Gloo would advertise 127.0.0.1 and the job would time out. Needs root and
`ip netns`; skipped with the reason otherwise. The namespaces are ours and removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from .test_launch import REPORT_ENV, finish, reports, start

ADDRS = ("10.231.77.1", "10.231.77.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and the `ip` tool to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    names = [f"rw{tag}a", f"rw{tag}b"]
    veth = [f"rwv{tag}a", f"rwv{tag}b"]
    try:
        steps = [
            *[("netns", "add", n) for n in names],
            ("link", "add", veth[0], "type", "veth", "peer", "name", veth[1]),
        ]
        for i in (0, 1):
            steps += [
                ("link", "set", veth[i], "netns", names[i]),
                ("-n", names[i], "addr", "add", f"{ADDRS[i]}/24", "dev", veth[i]),
                ("-n", names[i], "link", "set", veth[i], "up"),
                ("-n", names[i], "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot build network namespaces here: ip {' '.join(step)}: "
                            f"{done.stderr.strip()}")  # fmt: skip
        yield names, veth
    finally:
        for n in names:  # deleting a namespace deletes its end of the veth pair (and the pair)
            _ip("netns", "del", n)


def test_two_namespaces_as_two_hosts(two_hosts, tmp_path: Path):
    names, veth = two_hosts
    (tmp_path / "report_env.py").write_text(REPORT_ENV)
    common = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", ADDRS[0],
              "--master-port", "29517", "--rdzv-timeout", "60"]  # fmt: skip
    procs = [
        start(
            *common,
            "--node-rank",
            str(i),
            "report_env.py",
            str(tmp_path),
            cwd=tmp_path,
            # c10's warnings (e.g. no hostname) go to a file there, named on stderr.
            prefix=("ip", "netns", "exec", names[i], "env", f"TMPDIR={tmp_path}"),
        )
        for i in (1, 0)
    ]
    for proc in procs:
        code, _, stderr = finish(proc, timeout=150)
        assert code == 0, stderr
    rep = reports(tmp_path)
    assert sorted(rep) == [0, 1]
    for rank, r in rep.items():
        assert (r["RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert r["MASTER_ADDR"] == ADDRS[0] and r["sum"] == 1 + 2
        # The launcher named the veth that reaches the master, in each namespace.
        assert r["GLOO_SOCKET_IFNAME"] == veth[rank]
