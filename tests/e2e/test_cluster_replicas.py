"""A host killed under ``--nnodes 1:3`` with in-memory replicas: the survivors continue at world 2
from the replicas (no disk checkpoint exists), the job grows back to 3 when a replacement
joins, and every step is trained. The seconds are benchmarks/recovery.py's; the bitwise
equality with a reference is tests/dist/test_replicas_dist.py's."""

from __future__ import annotations

import itertools

import pytest

from cluster import replicas
from cluster.required import require_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])  # zero3: replicas of shards, resharded
def test_a_lost_host_shrinks_the_job_and_a_returning_one_grows_it_back(tmp_path, strategy):
    require_cluster()
    r = replicas.host_lost(tmp_path, strategy=strategy)  # stopped 5 steps after growing back
    assert not r["hung"] and r["codes"] == [0, 0, 0], r["text"]
    worlds = r["worlds"]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3, worlds
    steps = r["steps"]
    assert all(b <= a + 1 for a, b in itertools.pairwise(steps)), steps  # no step skipped
    assert 0 <= r["steps_lost"] <= 1, r  # replicas after every step
    lines = r["shrink_lines"]
    assert any("shrank from 3 to 2" in line for line in lines), lines
    assert any("grew from 2 to 3" in line for line in lines), lines
    causes = "\n".join(r["cause_lines"])  # the launcher still names the lost machine first
    assert "node 2 (rank 2) stopped responding" in causes and "restarting all workers" in causes
    assert not list((tmp_path / "out").glob("disk")), "no disk checkpoint was written"
