"""The test cluster itself (tests/cluster): nodes that reach each other and nothing else, a
silent partition that heals, a node killed whole, a rate limit that holds, nothing left behind.

Plain Python sockets on the nodes (no torch): these run in seconds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import netns

pytestmark = pytest.mark.cluster

# A TCP server on a node: accepts connections, answers b"pong" to each, until killed.
SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.recv(16)
    c.sendall(b"pong")
    c.close()
"""

# Connect to each HOST (port 7000), say what happened: pong, timeout, refused, unreachable.
CLIENT = """
import socket, sys
wait = float(sys.argv[1])
for host in sys.argv[2:]:
    try:
        with socket.create_connection((host, 7000), timeout=wait) as c:
            c.sendall(b"ping"); print(c.recv(16).decode())
    except socket.timeout:
        print("timeout")
    except ConnectionRefusedError:
        print("refused")
    except OSError as exc:
        print("unreachable" if exc.errno in (101, 113) else f"error {exc.errno}")
"""


def _server(cluster: netns.Cluster, node: int, port: int = 7000) -> subprocess.Popen:
    proc = cluster.popen(node, [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE,
                         text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _ping(cluster: netns.Cluster, src: int, *hosts: str, wait: float = 3) -> list[str]:
    """One process on node ``src`` tries every host in turn (a Python start is slow here)."""
    done = cluster.run(src, [sys.executable, "-c", CLIENT, str(wait), *hosts], timeout=120)
    return done.stdout.split()


def test_nodes_reach_each_other_and_nothing_else(make_cluster):
    c = make_cluster(3)
    for i in range(3):
        _server(c, i)  # ended with the cluster
    for src in range(3):
        names = [n.addr for n in c.nodes] + [n.hostname for n in c.nodes]  # /etc/hosts too
        # Only the cluster's own /24 is routed: any other address fails at once, unsent; the
        # node's loopback holds its own server.
        got = _ping(c, src, *names, "10.231.78.1", "127.0.0.1")
        assert got == ["pong"] * 6 + ["unreachable", "pong"], (src, got)
    routes = c.run(0, ["ip", "-4", "route", "show"]).stdout.split("\n")
    assert [r.split()[0] for r in routes if r] == [f"{c.subnet}.0/24"]


def test_a_partition_is_silent_and_heals(make_cluster):
    c = make_cluster(3)
    _server(c, 1)
    _server(c, 2)
    n1, n2 = c.nodes[1].addr, c.nodes[2].addr
    c.partition(2)
    # Dropped, not refused; the cut-off node still reaches itself.
    assert _ping(c, 0, n1, n2, wait=2) == ["pong", "timeout"]
    assert _ping(c, 2, n2) == ["pong"]
    c.partition(1, 2)  # nodes 1 and 2 on one side: they reach each other, not node 0
    assert _ping(c, 1, n2) == ["pong"]
    assert _ping(c, 0, n1, wait=2) == ["timeout"]
    c.heal()
    assert _ping(c, 0, n1, n2) == ["pong", "pong"]


def test_kill_ends_every_process_of_one_node(make_cluster):
    c = make_cluster(2)
    keep = _server(c, 0)
    sleepers = [c.popen(1, ["sleep", "300"]) for _ in range(3)]
    _server(c, 1)
    assert len(c.pids(1)) == 4
    killed = c.kill(1)
    assert {p.pid for p in sleepers} <= set(killed)
    for p in sleepers:
        assert p.wait(10) == -9
    assert c.pids(1) == [] and keep.poll() is None
    assert _ping(c, 0, c.nodes[1].addr) == ["refused"]  # the machine is up, its server gone


def _transfer_seconds(c: netns.Cluster, nbytes: int) -> float:
    send = f"""
import socket, time
t = time.monotonic()
with socket.create_connection(("{c.nodes[1].addr}", 7001), timeout=60) as s:
    s.sendall(b"x" * {nbytes}); s.shutdown(socket.SHUT_WR); s.recv(1)
print(time.monotonic() - t)
"""
    sink = c.popen(1, [sys.executable, "-c", "import socket; s = socket.create_server(('', 7001)); "
                   "print('ready', flush=True); c, _ = s.accept()\nwhile c.recv(65536): pass\n"
                   "c.sendall(b'k')"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert sink.stdout.readline().strip() == "ready"
    return float(c.run(0, [sys.executable, "-c", send], timeout=120).stdout)


def test_a_rate_limit_holds_and_is_lifted(make_cluster):
    c = make_cluster(2)
    c.shape(0, rate="2mbit")
    shown = c.run(0, ["tc", "qdisc", "show", "dev", "net0"]).stdout
    assert "tbf" in shown and "rate 2Mbit" in shown, shown
    # 500 kB at 2 Mbit/s take 2 s; less the 64 kB burst: never under 1.7 s (load only slows).
    assert _transfer_seconds(c, 500_000) >= 1.7
    c.unshape(0)
    assert "tbf" not in c.run(0, ["tc", "qdisc", "show", "dev", "net0"]).stdout


def test_delay_and_loss_need_netem(make_cluster):
    c = make_cluster(2)
    reason = netns.netem_unavailable()
    if reason is not None:
        with pytest.raises(netns.Unavailable, match="netem"):
            c.shape(0, delay="50ms")
        pytest.skip(reason)
    c.shape(0, delay="50ms")  # each way: a round trip of at least 100 ms
    _server(c, 1)
    begin = time.monotonic()
    assert _ping(c, 0, c.nodes[1].addr) == ["pong"]
    assert time.monotonic() - begin >= 0.2  # SYN/SYN-ACK and ping/pong: two round trips


def test_what_a_dead_owner_left_is_swept_and_a_live_cluster_is_not(make_cluster, tmp_path: Path):
    live = make_cluster(1)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-abcdef-n0"
    netns.ip("netns", "add", stale)
    (netns.HOSTS_DIR / stale).mkdir(parents=True, exist_ok=True)
    assert stale in netns.sweep()
    names = {p.name for p in netns.NETNS_DIR.iterdir()}
    assert stale not in names and not (netns.HOSTS_DIR / stale).exists()
    assert live.nodes[0].netns in names  # its owner (this process) runs


def test_close_removes_everything(make_cluster):
    c = make_cluster(2)
    c.popen(1, ["sleep", "300"])
    made = [c.switch, *[n.netns for n in c.nodes]]
    c.close()
    names = {p.name for p in netns.NETNS_DIR.iterdir()} if netns.NETNS_DIR.exists() else set()
    assert not set(made) & names
    assert not any((netns.HOSTS_DIR / n).exists() for n in made)


def test_ci_runs_the_cluster_tier_as_root_and_never_skips_it(monkeypatch):
    steps = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    root = steps[steps.index('if [ "$(id -u)" = 0 ]') : steps.index("python -m pytest")]
    assert "apt-get install -y -qq slurm-wlm" in root
    assert "export RANKWISE_CLUSTER_TESTS=required" in root
    from cluster import required

    monkeypatch.setenv(required.REQUIRED_ENV, "required")
    with pytest.raises(pytest.fail.Exception, match="the cluster tier must run here"):
        required.skip_or_fail("no test cluster here: needs root")
    monkeypatch.setenv(required.REQUIRED_ENV, "")
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        required.skip_or_fail("no test cluster here: needs root")


def test_unavailable_names_the_reason(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "root" in netns.unavailable()
    with pytest.raises(netns.Unavailable, match="root"):
        netns.Cluster(2).start()
