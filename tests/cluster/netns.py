"""N hosts on one machine: network namespaces joined by a bridge, shaped, split, healed, killed.

Each node is a network namespace with its loopback and one interface (``net0``) holding its own
address; the link is a veth pair whose other end is a port of a bridge that lives in a
namespace of its own (the "switch"). Nothing is created in the machine's own namespace, so the
nodes reach only each other (and their own loopback): no route leads anywhere else.

- ``shape(node, rate=..., delay=..., loss=...)``: tc on both ends of the node's link (a token
  bucket for the rate alone; netem for delay and loss, where the kernel has it).
- ``Cluster(..., private_shm='2g')``: every command on a node gets a /dev/shm of its own (a
  mount namespace with a private tmpfs): two machines share no memory, and without it the
  ranks of different "nodes" could map each other's shared-memory files.
- ``partition(*nodes)``: those nodes' ports move to a second bridge: they still reach each
  other, the rest do not, and nobody is told (the cable stays plugged in, as when a switch or
  a firewall drops the traffic): packets vanish, TCP retransmits. ``heal()`` moves them back.
- ``kill(node)``: SIGKILL to every process in the node's namespace (``ip netns pids``), as when
  a machine's processes all crash: the kernel closes their sockets, the peers see it.
- ``add_dead_end(node, ifname, addr, hostname=True)``: a second interface that reaches nobody,
  where the machine's hostname resolves on that node (Gloo would bind there unless told).

Each node has its own /etc/hosts (``/etc/netns/<ns>/hosts``, which ``ip netns exec``
bind-mounts): ``node0``, ``node1``... by address, and the machine's hostname at 127.0.0.1, as in
many containers. Processes run on a node through ``popen``/``run`` (``ip netns exec``).

Every name starts with ``rwc-<pid>-``: ``sweep()`` (run by ``start``) removes what an owner
that no longer runs left behind (a test killed mid-way), and never touches a live cluster.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

PREFIX = "rwc-"
NETNS_DIR = Path("/run/netns")
HOSTS_DIR = Path("/etc/netns")  # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts on /etc/hosts


class Unavailable(RuntimeError):
    """This machine cannot build the cluster (not root, no `ip`, no namespaces, no veth...)."""


@dataclass(frozen=True)
class Node:
    """One host: its namespace, address and interface, and its name in every node's /etc/hosts."""

    index: int
    netns: str
    addr: str
    ifname: str = "net0"

    @property
    def hostname(self) -> str:
        return f"node{self.index}"


def ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise Unavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def in_ns(netns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    if check and done.returncode != 0:
        raise Unavailable(f"{' '.join(argv)} in {netns}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why no cluster can be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, a bridge)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` tool (iproute2)"
    return None


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _owner(name: str) -> int | None:
    parts = name[len(PREFIX) :].split("-")
    return int(parts[0]) if parts and parts[0].isdigit() else None


def netns_pids(netns: str) -> list[int]:
    done = ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def kill_all(netns: str, rounds: int = 50) -> list[int]:
    """SIGKILL every process in ``netns`` until none is left (a dying launcher may fork)."""
    killed: list[int] = []
    for _ in range(rounds):
        pids = netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.05)
    return killed


def remove_netns(netns: str) -> None:
    kill_all(netns)
    ip("netns", "del", netns, check=False)
    shutil.rmtree(HOSTS_DIR / netns, ignore_errors=True)


def sweep() -> list[str]:
    """Remove namespaces (and their /etc/netns files) whose owning process is gone."""
    names = {p.name for p in NETNS_DIR.glob(PREFIX + "*")} if NETNS_DIR.is_dir() else set()
    names |= {p.name for p in HOSTS_DIR.glob(PREFIX + "*")} if HOSTS_DIR.is_dir() else set()
    stale = [n for n in sorted(names) if (o := _owner(n)) is not None and not _alive(o)]
    for name in stale:
        remove_netns(name)
    return stale


class Cluster:
    """``nodes`` hosts at ``<subnet>.1`` .. ``<subnet>.N`` (a /24), one bridge between them.

    Use as a context manager, or ``start()`` then ``close()`` (``close`` also runs when
    ``start`` fails half-way). Addresses are private to the cluster's namespaces: two clusters
    with the same subnet never see each other.
    """

    def __init__(
        self, nodes: int = 2, *, subnet: str = "10.231.77", private_shm: str | None = None
    ) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes={nodes}: expected 1..200")
        self.private_shm = private_shm
        """A size ('2g'): every command runs with a /dev/shm of its own (a mount namespace
        with a private tmpfs), as on machines that share no memory; None: the machine's."""
        self.tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-sw"
        self.subnet = subnet
        self.nodes = [
            Node(i, f"{self.tag}-n{i}", f"{subnet}.{i + 1}") for i in range(nodes)
        ]
        self.extra_interfaces: dict[int, list[str]] = {}
        self._made: list[str] = []

    # -- building and removing ---------------------------------------------------------------

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Cluster:
        reason = unavailable()
        if reason:
            raise Unavailable(reason)
        sweep()
        try:
            self._add_netns(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "add", "br1", "type", "bridge")  # the far side of a split
            for br in ("br0", "br1", "lo"):
                ip("-n", self.switch, "link", "set", br, "up")
            for node in self.nodes:
                self._add_node(node)
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)

    def _add_node(self, node: Node) -> None:
        self._add_netns(node.netns)
        port = f"p{node.index}"
        ip("link", "add", node.ifname, "netns", node.netns, "type", "veth", "peer", "name", port,
           "netns", self.switch)  # fmt: skip
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
        for dev in (node.ifname, "lo"):
            ip("-n", node.netns, "link", "set", dev, "up")
        self._write_hosts(node)

    def _write_hosts(self, node: Node, own: str = "127.0.0.1") -> None:
        # The machine's own hostname resolves to 127.0.0.1 in every node, as in many containers
        # (or to ``own``): Gloo must be told which interface reaches the master.
        name = os.uname().nodename
        lines = ["127.0.0.1 localhost", f"{own} {name}"]
        lines += [f"{n.addr} {n.hostname}" for n in self.nodes]
        # ... and the IPv6-mapped address a dual-stack socket (torch's store) reports, under a
        # name of its own (so that looking up "node1" still gives its IPv4 address only).
        lines += [f"::ffff:{n.addr} {n.hostname}-mapped" for n in self.nodes]
        folder = HOSTS_DIR / node.netns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("\n".join(lines) + "\n")
        # Names the hosts file does not hold are asked of a resolver on the node's own
        # loopback, where nothing listens: no query leaves the node.
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\n")

    def close(self) -> None:
        """Kill every process in the cluster and remove every namespace and file it made."""
        for name in reversed(self._made):
            remove_netns(name)
        self._made.clear()

    # -- running things on a node ---------------------------------------------------------------

    def prefix(self, node: Node | int) -> list[str]:
        """The argv prefix that runs a command on ``node`` (with ``private_shm``: in a mount
        namespace of its own, a fresh tmpfs on /dev/shm)."""
        netns = ["ip", "netns", "exec", self.node(node).netns]
        if self.private_shm is None:
            return netns
        mount = f'mount -t tmpfs -o size={self.private_shm} tmpfs /dev/shm && exec "$@"'
        return [*netns, "unshare", "-m", "--propagation", "private", "sh", "-c", mount,
                "node-shm"]  # fmt: skip

    def node(self, node: Node | int) -> Node:
        return self.nodes[node] if isinstance(node, int) else node

    def popen(self, node: Node | int, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix(node), *argv], **kwargs)

    def run(self, node: Node | int, argv: list[str], timeout: float = 60, **kwargs):
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.prefix(node), *argv], timeout=timeout, **kwargs)

    def pids(self, node: Node | int) -> list[int]:
        return netns_pids(self.node(node).netns)

    # -- faults ----------------------------------------------------------------------------------

    def kill(self, node: Node | int) -> list[int]:
        """SIGKILL every process on ``node``; returns their pids."""
        return kill_all(self.node(node).netns)

    def partition(self, *nodes: Node | int) -> None:
        """Cut ``nodes`` off from the others (they still reach each other), silently."""
        for n in map(self.node, nodes):
            ip("-n", self.switch, "link", "set", f"p{n.index}", "master", "br1")

    def heal(self) -> None:
        """Every node back on one bridge."""
        for n in self.nodes:
            ip("-n", self.switch, "link", "set", f"p{n.index}", "master", "br0")

    def shape(
        self,
        node: Node | int,
        *,
        rate: str | None = None,
        delay: str | None = None,
        loss: str | None = None,
        burst: str = "64kb",
    ) -> None:
        """Shape ``node``'s link both ways: ``rate='1gbit'``, ``delay='0.5ms'``, ``loss='1%'``.

        A rate alone is a token bucket (tbf, in every kernel; ``burst``: its bucket, at least
        rate / HZ for the rate to be reached); delay or loss need netem (``Unavailable`` names
        the missing kernel module where it is not built).
        """
        n = self.node(node)
        if delay or loss:
            reason = netem_unavailable()
            if reason:
                raise Unavailable(reason)
            spec = ["netem"] + (["delay", delay] if delay else []) + (["loss", loss] if loss else [])
            spec += (["rate", rate] if rate else []) + ["limit", "100000"]
        elif rate:
            spec = ["tbf", "rate", rate, "burst", burst, "latency", "100ms"]
        else:
            raise ValueError("shape() needs rate, delay or loss")
        for ns, dev in ((n.netns, n.ifname), (self.switch, f"p{n.index}")):
            in_ns(ns, "tc", "qdisc", "replace", "dev", dev, "root", *spec)

    def rate_commands(
        self, node: Node | int, rate: str, burst: str = "16kb"
    ) -> tuple[list[list[str]], list[list[str]]]:
        """The argv lists that shape ``node``'s link both ways to ``rate`` (a token bucket), and
        those that undo it: for a process that slows its own node's link at a step of its own."""
        n = self.node(node)
        ends = ((n.netns, n.ifname), (self.switch, f"p{n.index}"))
        spec = ["tbf", "rate", rate, "burst", burst, "latency", "100ms"]
        on = [["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *spec]
              for ns, dev in ends]  # fmt: skip
        off = [["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"]
               for ns, dev in ends]  # fmt: skip
        return on, off

    def unshape(self, node: Node | int) -> None:
        n = self.node(node)
        for ns, dev in ((n.netns, n.ifname), (self.switch, f"p{n.index}")):
            in_ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def add_dead_end(
        self, node: Node | int, ifname: str, addr: str, *, hostname: bool = False
    ) -> None:
        """A second interface on ``node`` with ``addr``/24 on a link that reaches nobody (its
        peer sits alone in the switch namespace, on no bridge); ``hostname``: the machine's
        hostname resolves to ``addr`` on that node (where Gloo would bind unless told)."""
        n = self.node(node)
        port = f"d{n.index}{len(self.extra_interfaces.setdefault(n.index, []))}"
        ip("link", "add", ifname, "netns", n.netns, "type", "veth", "peer", "name", port,
           "netns", self.switch)  # fmt: skip
        ip("-n", self.switch, "link", "set", port, "up")
        ip("-n", n.netns, "addr", "add", f"{addr}/24", "dev", ifname)
        ip("-n", n.netns, "link", "set", ifname, "up")
        self.extra_interfaces[n.index].append(ifname)
        if hostname:
            self._write_hosts(n, own=addr)


_NETEM: dict[str, str | None] = {}


def netem_unavailable() -> str | None:
    """Why ``tc ... netem`` cannot run here (a kernel without sch_netem), or None."""
    if "reason" in _NETEM:
        return _NETEM["reason"]
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-probe"
    reason = unavailable()
    if reason is None:
        try:
            ip("netns", "add", name)
            done = in_ns(name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                         check=False)  # fmt: skip
            if done.returncode != 0:
                reason = (f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM; tc says "
                          f"{done.stderr.strip()!r}): no delay or loss, rates only")  # fmt: skip
        finally:
            remove_netns(name)
    _NETEM["reason"] = reason
    return reason
