"""An unreachable --master-addr: our message on stderr, torch's C++ frames in the named log.

The launcher runs in a network namespace of its own with only a loopback interface, so the
TEST-NET-1 address 192.0.2.1 (RFC 5737, never routed) has no route: nothing leaves this
machine. Needs root and `ip netns`; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import pytest

from cluster.netns import ip

from .test_launch import REPORT_ENV, finish, start

UNROUTED = "192.0.2.1"


@pytest.fixture
def isolated_netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and the `ip` tool to create a network namespace")
    name = f"rw{uuid.uuid4().hex[:6]}n"
    try:
        for step in (("netns", "add", name), ("-n", name, "link", "set", "lo", "up")):
            done = ip(*step, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot build a network namespace here: ip {' '.join(step)}: "
                            f"{done.stderr.strip()}")  # fmt: skip
        yield name
    finally:
        ip("netns", "del", name, check=False)


def test_unreachable_master_prints_our_message_and_keeps_the_frames(isolated_netns, tmp_path):
    (tmp_path / "report_env.py").write_text(REPORT_ENV)
    proc = start(
        "run", "--nnodes", "2", "--node-rank", "1", "--master-addr", UNROUTED,
        "--master-port", "29531", "--rdzv-timeout", "3", "report_env.py", str(tmp_path),
        cwd=tmp_path, prefix=("ip", "netns", "exec", isolated_netns, "env", f"TMPDIR={tmp_path}"),
    )  # fmt: skip
    code, _, stderr = finish(proc, timeout=60)
    assert code == 1, stderr
    assert (
        f"rankwise run: error: node 1 of 2 could not complete the static rendezvous at "
        f"{UNROUTED}:29531 within --rdzv-timeout=3s"
    ) in stderr
    assert "Fix: start node 0 first" in stderr
    assert "frame #" not in stderr and "Exception raised from" not in stderr, stderr
    assert not re.search(r"^\[[WE]\d{4} ", stderr, re.M), stderr
    # The message names the file; no --log-dir, so it is in the temporary folder.
    found = re.search(r"torch's native log \((\d+) lines?: .*\) is kept in (\S+)", stderr)
    assert found, stderr
    log = Path(found[2])
    assert log.parent == tmp_path
    text = log.read_text()
    assert len(text.splitlines()) == int(found[1])
    assert f"failed to connect to any network address of ({UNROUTED}, 29531)" in text
    assert "frame #0: " in text and "TCPStore" in text
