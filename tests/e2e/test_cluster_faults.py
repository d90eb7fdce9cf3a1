"""Faults between machines (tests/cluster/faults.py runs them; benchmarks/_faults_cluster.py
counts them): a node killed, mid-step and mid-save; the link cut for good, and cut then healed;
a killed node replaced under an elastic job.

Short timeouts through rankwise's own settings (``rw.init(timeout=...)`` in the script,
``RANKWISE_STALL_REPORT_S``), so that "ends at the timeout, not at torch's 30 minutes" is seen
in seconds. The ≤ 10 s / ≤ 60 s figures are the benchmark's; these tests bound what would
otherwise be a hang.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster import faults
from cluster.required import require_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCENARIOS = {  # run three at a time, in this order, from the start of the module
    "killed": (faults.node_killed, {"victim": 1}),
    # c10d: its agents also talk to the store while the job runs (the cut-off side must end);
    # a static job's cut is benchmarks/faults.py's link_cut row.
    "cut": (faults.partitioned, {"stall_s": 4, "timeout": 15, "rdzv": "c10d"}),
    "healed": (faults.healed, {"cut_s": 6, "timeout": 40}),
    "killed_mid_save": (faults.node_killed, {"victim": 0, "during_save": True, "nproc": 1}),
    "replaced": (faults.node_replaced, {}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario starts at once (three at a time: most of a fault's time is waiting for
    it), each on its own cluster; each test waits for its own."""
    require_cluster()
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="cluster-fault")
    futures = {
        name: pool.submit(fn, tmp_path_factory.mktemp(name), **kwargs)
        for name, (fn, kwargs) in SCENARIOS.items()
    }
    yield {name: (lambda f=f: f.result(timeout=600)) for name, f in futures.items()}
    pool.shutdown(wait=True, cancel_futures=True)


def test_a_killed_node_is_named_and_the_survivors_stop_at_once(runs):
    r = runs["killed"]()
    assert not r["hung"], r["summary"]
    assert r["code"] == 1 and r["seconds"] < 60, r  # the timeout is 120 s: not waited for
    summary = r["summary"]
    assert summary.startswith("rankwise run: node 1 (ranks 2, 3) stopped responding"), summary
    assert "(world size 4, node 0)" in summary
    assert "Every rank of node 1 (ranks 2, 3) stopped responding" in summary  # the diagnosis
    assert "Fix: find out what happened to node 1" in summary
    assert not r["lost"]


def test_the_writers_node_killed_mid_save_loses_no_checkpoint(runs):
    r = runs["killed_mid_save"]()
    assert not r["hung"], r["summary"]
    assert r["mid_write"], "the kill did not land inside a checkpoint's write"
    # Node 1's ranks hear node 0's store close: they name the master's machine.
    assert r["named"], r["summary"]
    assert not r["lost"], "latest does not load, or is older than the last save that returned"
    assert r["code"] == 1 and r["seconds"] < 60, r


def test_a_cut_link_is_reported_naming_the_node_and_both_sides_end(runs):
    r = runs["cut"]()
    assert not r["hung"], r
    assert r["codes"] == [1, 1], r  # the cut-off agent's store calls gave up (rdzv_guard)
    # Node 0 names the silent node early; node 1 names the store it cannot reach.
    assert r["seconds"] is not None and "stall: rank(s) 1 (node 1) stopped responding" in r["stall"]
    assert r["summaries"][0].startswith("rankwise run: node 1 (rank 1) stopped responding"), r
    cut_off = r["summaries"][1]  # c10d gave it rank 1: its headline says so
    assert "the job's store at 10.231.77.1:" in cut_off and "(on the master's machine)" in cut_off
    assert "did not answer them: this node (node 1) is cut off" in cut_off, cut_off
    assert "(world size 2, node 1)" in cut_off
    assert "Fix: check the network between this node and 10.231.77.1" in cut_off
    assert r["end_s"] < 15 + 60  # the timeout, the store's read limit, the exit: no hang
    assert not r["lost"]


def test_a_link_healed_before_the_timeout_goes_on_without_divergence(runs):
    r = runs["healed"]()
    assert not r["hung"] and r["codes"] == [0, 0], r
    assert r["steps"] == 40 and r["cut_at"] < 40, r
    assert r["replicas_equal"], "the replicas differ after the partition healed"
    assert not r["lost"]


def test_a_replaced_node_rejoins_and_training_resumes_bit_exact(runs):
    r = runs["replaced"]()
    assert not r["hung"] and r["codes"] == [0, 0], r
    assert r["resumed"], "the job did not resume from a checkpoint"
    assert "resumed from step" in r["resumed"][0] and "(world size 2)" in r["resumed"][0]
    assert r["bit_exact"], "the replaced run differs from the uninterrupted one"
    assert not r["lost"]
