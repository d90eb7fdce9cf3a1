"""The faults of issue 36 for benchmarks/faults.py: several machines, as network namespaces.

Each trial runs on a fresh test cluster (tests/cluster: namespaces joined by a bridge, root
only) through tests/cluster/faults.py, the same scenarios tests/e2e/test_cluster_faults.py
asserts on:

- ``node_killed``: 2 nodes x 2 workers, every process of node 1 SIGKILLed mid-step; seconds
  until node 0's launcher ended (target <= 10); ``unnamed``: summaries that did not say
  "node 1 (ranks 2, 3) stopped responding".
- ``node_killed_mid_save``: 2 nodes x 1 worker (a 40 MB checkpoint), node 0 (rank 0, the
  writer, and the store's host) killed while the file is written; ``lost``: ``latest`` did not
  load or was older than the last save that returned; ``mid_write``: kills inside the write.
- ``link_cut``: node 1's link cut for good mid-step (packets dropped silently); seconds to node
  0's stall report naming node 1 (RANKWISE_STALL_REPORT_S, rankwise's 50 unless --stall-s;
  target <= 60); ``end_s_max``: until both nodes had ended (the timeout is the report + 30 s).
- ``link_healed``: the link cut for 10 s, then healed, well before the timeout: seconds from
  the heal to the end; ``diverged``: runs whose replicas differ at the end.
- ``node_replaced``: --nnodes 1:2 --max-restarts 1 over c10d, node 1 killed and a replacement
  started; seconds from the kill to the end; ``diverged``: runs not bit-identical to an
  uninterrupted run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# tests/ is on the path from here on: the cluster and its scenarios are the tests' own.
from cluster import faults, unavailable


def _named(r: dict) -> dict:
    return {**r, "unnamed": not r.pop("named")}


def _trials(n: int, trial: Callable[[], dict]) -> Callable[[], list[dict]]:
    return lambda: [trial() for _ in range(n)]


def plan(trials: int, stall_s: float, tmp: Callable[[], Path]) -> dict[str, Callable]:
    """The rows, each a callable returning its trials' results (nothing where no cluster can
    be built: not root, no iproute2). ``link_cut`` waits for the stall report: a third of the
    trials (at least one)."""
    reason = unavailable()
    if reason is not None:
        print(f"cluster rows skipped: {reason}", file=sys.stderr)
        return {}
    mid_save = {"victim": 0, "during_save": True, "nproc": 1}
    cut = {"stall_s": stall_s, "timeout": stall_s + 30}
    return {
        "node_killed": _trials(trials, lambda: _named(faults.node_killed(tmp(), victim=1))),
        "node_killed_mid_save": _trials(
            trials, lambda: _named(faults.node_killed(tmp(), **mid_save))
        ),
        "link_cut": _trials(max(1, trials // 3), lambda: faults.partitioned(tmp(), **cut)),
        "link_healed": _trials(trials, lambda: faults.healed(tmp(), cut_s=10, timeout=90)),
        "node_replaced": _trials(trials, lambda: faults.node_replaced(tmp())),
    }
