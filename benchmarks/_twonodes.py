"""Two hosts on one machine for a benchmark: the test cluster's nodes, with a private /dev/shm.

The namespaces, the link and its shaping are the test cluster's (tests/cluster/netns.py, one
implementation for tests and benchmarks); this adapter keeps the two-node view the benchmark
and tests/e2e/test_hierarchical_netns.py use:

- node ``i`` is a network namespace with its loopback and one interface (``ifname[i]``) at
  ``addr[i]``, joined to the other through the cluster's bridge: the two nodes reach each other
  and nothing else;
- ``shape(rate, delay)`` shapes node 0's link both ways, so each direction is shaped once:
  netem (rate and delay) where the kernel has it, else a token bucket (``tbf rate R``) with no
  delay, and ``shaping`` says so;
- ``prefix(i)`` runs a command on node ``i`` in a mount namespace of its own with a private
  tmpfs on ``/dev/shm``: two real machines do not share memory, and without it the ranks of
  both "nodes" would map each other's shared-memory files;
- leaving the ``with`` block kills every process left in the namespaces and removes them (also
  when building fails half-way); a killed run's leftovers are swept by the next cluster.

Root only; ``unavailable()`` says why not otherwise.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# tests/ is on the path from here on: the cluster is the tests' own.
from cluster import Cluster, Unavailable, netem_unavailable
from cluster import unavailable as _cluster_unavailable

__all__ = ["TwoNodes", "Unavailable", "unavailable"]


def unavailable() -> str | None:
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` tool"
    return _cluster_unavailable()


class TwoNodes:
    """Two nodes of a test cluster, each with its own /dev/shm; use as a context manager."""

    def __init__(self, *, subnet: str = "10.233.41", shm_size: str = "2g") -> None:
        self.cluster = Cluster(2, subnet=subnet, private_shm=shm_size)
        self.netns = [n.netns for n in self.cluster.nodes]
        self.ifname = [n.ifname for n in self.cluster.nodes]
        self.addr = [n.addr for n in self.cluster.nodes]
        self.shaping: dict = {"qdisc": None}

    def __enter__(self) -> TwoNodes:
        self.cluster.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.cluster.close()

    def shape(self, rate: str, delay: str | None) -> dict:
        """``rate`` (e.g. '1gbit') and ``delay`` (e.g. '0.5ms') on the link, each direction."""
        why_no_netem = netem_unavailable() if delay else None
        use_delay = delay if why_no_netem is None else None
        # tbf's bucket must hold rate / HZ (500 kB at 1 Gbit/s, HZ 250) for the rate to be reached
        self.cluster.shape(0, rate=rate, delay=use_delay, burst="256kb")
        qdisc = (f"netem rate {rate} delay {delay} limit 100000" if use_delay
                 else f"tbf rate {rate} burst 256kb latency 100ms")  # fmt: skip
        self.shaping = {"rate": rate, "delay": use_delay, "asked_delay": delay, "qdisc": qdisc,
                        "both_ends": True}  # fmt: skip
        if why_no_netem is not None:
            self.shaping["no_delay_because"] = (
                f"{why_no_netem}: the rate is a token bucket and the link adds no delay"
            )
        return self.shaping

    def prefix(self, i: int) -> list[str]:
        """argv prefix running a command on node ``i`` with a private /dev/shm."""
        return self.cluster.prefix(i)
