"""Two hosts on one machine for a benchmark: network namespaces, a shaped veth link, private /dev/shm.

A minimal stand-in for the cluster fixture (tests/cluster), small enough to fold into it:

- node ``i`` is the namespace ``rwh-<pid>-<tag>-n<i>`` with its loopback and one end of a veth
  pair at ``10.233.<k>.<i+1>/24``: the two nodes reach each other and nothing else;
- ``shape(rate, delay)`` puts the rate (and delay) on **both** ends of the link, so each
  direction is shaped once, at its sender: ``netem rate R delay D`` where the kernel has netem,
  else a token bucket (``tbf rate R``) with no delay, and ``shaping`` says so;
- ``prefix(i)`` runs a command on node ``i`` in a mount namespace of its own with a private
  tmpfs on ``/dev/shm``: two real machines do not share memory, and without it the ranks of
  both "nodes" would map each other's shared-memory files;
- ``close()`` kills every process left in the namespaces and removes them (also when ``start``
  fails half-way); ``sweep()`` removes what a killed run left behind.

Root only; ``unavailable()`` says why not otherwise. Traffic goes only between the two
namespaces made here (and their loopbacks).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

PREFIX = "rwh-"
NETNS_DIR = Path("/run/netns")


class Unavailable(RuntimeError):
    """This machine cannot build the two nodes."""


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, a veth pair, tc)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` tool"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise Unavailable(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def _kill_all(netns: str) -> None:
    for _ in range(50):
        pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def sweep() -> list[str]:
    """Remove ``rwh-<pid>-*`` namespaces whose owner process is gone."""
    stale = []
    for path in NETNS_DIR.glob(PREFIX + "*") if NETNS_DIR.is_dir() else []:
        owner = path.name[len(PREFIX) :].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _kill_all(path.name)
            _run("ip", "netns", "del", path.name, check=False)
            stale.append(path.name)
    return stale


class TwoNodes:
    """Two namespaces joined by one veth pair; use as a context manager."""

    def __init__(self, *, subnet: str = "10.233.41", shm_size: str = "2g") -> None:
        tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.netns = [f"{tag}-n0", f"{tag}-n1"]
        self.ifname = ["rwh0", "rwh1"]
        self.addr = [f"{subnet}.1", f"{subnet}.2"]
        self.shm_size = shm_size
        self.shaping: dict = {"qdisc": None}
        self._made: list[str] = []

    def __enter__(self) -> TwoNodes:
        reason = unavailable()
        if reason:
            raise Unavailable(reason)
        sweep()
        try:
            for ns in self.netns:
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            _run("ip", "link", "add", self.ifname[0], "netns", self.netns[0], "type", "veth",
                 "peer", "name", self.ifname[1], "netns", self.netns[1])  # fmt: skip
            for ns, dev, addr in zip(self.netns, self.ifname, self.addr, strict=True):
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for ns in reversed(self._made):
            _kill_all(ns)
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()

    def shape(self, rate: str, delay: str | None) -> dict:
        """``rate`` (e.g. '1gbit') and ``delay`` (e.g. '0.5ms') on both ends of the link."""
        netem = ["netem", "rate", rate] + (["delay", delay] if delay else []) + ["limit", "100000"]
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
        why_no_netem = None
        for ns, dev in zip(self.netns, self.ifname, strict=True):
            done = _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                        *netem, check=False)  # fmt: skip
            if done.returncode != 0:
                why_no_netem = done.stderr.strip()
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)
        self.shaping = {
            "rate": rate,
            "delay": delay if why_no_netem is None else None,
            "asked_delay": delay,
            "qdisc": " ".join(netem if why_no_netem is None else tbf),
            "both_ends": True,
        }
        if why_no_netem is not None:
            self.shaping["no_delay_because"] = (
                f"this kernel has no netem qdisc (tc says {why_no_netem!r}): the rate is a "
                "token bucket and the link adds no delay"
            )
        return self.shaping

    def prefix(self, i: int) -> list[str]:
        """argv prefix running a command on node ``i`` with a private /dev/shm."""
        mount = f'mount -t tmpfs -o size={self.shm_size} tmpfs /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.netns[i], "unshare", "-m", "--propagation",
                "private", "sh", "-c", mount, "node-shm"]  # fmt: skip
