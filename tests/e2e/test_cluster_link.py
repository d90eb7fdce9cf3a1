"""A slow link to one node, named: three namespace nodes, one rank each, our DDP on a small GPT
(tests/dist/timing_cases.py under ``rankwise run``); from step 30 node 2's link is shaped to
16 Mbit/s both ways (``tc tbf``: this kernel may lack netem, a rate needs none). Nobody's own
work slows, every rank's communication does: the straggler named must be node 2, kind
``communication``, with the probe's evidence, and no rank named for compute or input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster import Cluster, jobs
from cluster.required import require_cluster
from rankwise.timing.files import read_jsonl

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = str(Path(__file__).parent / "scripts" / "link_train.py")
STEPS, ONSET, SLOW = 90, 30, 2  # 90 batches of data: 60 steps on each of 3 ranks


def test_a_slow_link_to_one_node_names_that_node_as_communication(tmp_path):
    require_cluster()
    with Cluster(3, subnet="10.231.81") as cluster:
        on, off = cluster.rate_commands(SLOW, "16mbit")
        env = {"RANKWISE_RUN_DIR": str(tmp_path / "run"), "RANKWISE_PROFILE_STEPS": "5",
               "RANKWISE_TEST_LINK": json.dumps({str(SLOW): [on, off]})}  # fmt: skip
        episodes = json.dumps([[ONSET, STEPS, SLOW]])
        launchers = jobs.start_job(cluster, [SCRIPT, str(STEPS), episodes], tmp_path, env=env,
                                   nproc=1, port=29511)  # fmt: skip
        codes = jobs.finish(launchers, timeout=150)
        assert codes == [0, 0, 0], jobs.describe(launchers)
    named = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "straggler"]
    assert named, jobs.describe(launchers)
    first = named[0]
    assert (first["kind"], first["scope"], first["node"]) == ("communication", "node", SLOW), named
    assert first["rank"] == SLOW and f"node {SLOW}" in first["why"], first
    assert ONSET <= first["step"] <= ONSET + 20, first  # named within 20 steps of the onset
    assert all(e["kind"] == "communication" for e in named), named
