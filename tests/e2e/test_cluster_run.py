"""`rankwise run` across real nodes: two network namespaces, each with its own address, two
workers each, meeting at the first node's address (static and c10d rendezvous).

Node 1 also has a second interface, on a link that reaches nobody, where the machine's
hostname resolves: Gloo left to itself would bind there and the job would time out; the
launcher must pick the interface that reaches the master, and `rankwise doctor` must say so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from cluster import jobs

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(Path(__file__).parent / "scripts" / "cluster_train.py")
DIGITS = str(ROOT / "examples" / "digits.py")
DEAD_END = "10.231.99.2"


def _states(folder: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {int(p.stem[4:]): torch.load(p, weights_only=True) for p in folder.glob("rank*.pt")}


def _envs(folder: Path) -> dict[int, dict]:
    return {int(p.stem[3:]): json.loads(p.read_text()) for p in folder.glob("env*.json")}


def test_two_nodes_train_like_one_node_and_pick_the_interface_that_reaches_the_master(
    make_cluster, tmp_path: Path
):
    cluster = make_cluster(2)
    cluster.add_dead_end(1, "dead0", DEAD_END, hostname=True)
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    one.mkdir(), two.mkdir()
    script = [TRAIN, "--strategy", "ddp,zero2", "--steps", "8"]
    # The oracle: one node, 4 processes, the same global batch (on this machine's loopback).
    oracle = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "4", *script, str(one)],
        cwd=one, env=jobs.rankwise_env(one), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    launchers = jobs.start_job(cluster, [script[0], str(two), *script[1:]], two, nproc=2)
    doctor = cluster.run(1, [sys.executable, "-m", "rankwise", "doctor", "--json", "--nnodes", "2",
                             "--node-rank", "1", "--nproc-per-node", "2", "--master-addr",
                             cluster.nodes[0].addr, "--master-port", "29500"],
                         env=jobs.rankwise_env(tmp_path), timeout=240)  # fmt: skip
    codes = jobs.finish(launchers, timeout=400)
    _, err = oracle.communicate(timeout=400)
    assert codes == [0, 0], jobs.describe(launchers)
    assert oracle.returncode == 0, err[-3000:]
    for strategy in ("ddp", "zero2"):
        want = _states(one / strategy)[0]
        got = _states(two / strategy)
        assert sorted(got) == [0, 1, 2, 3]
        for rank, state in got.items():  # bit for bit: the same sums in the same order
            assert all(torch.equal(state[k], want[k]) for k in want), (strategy, rank)
        envs = _envs(two / strategy)
        for rank, e in envs.items():
            assert (e["world"], e["node"], e["local"]) == (4, rank // 2, rank % 2), e
            # Both nodes use the interface that reaches node 0; node 1's hostname says dead0.
            assert e["GLOO_SOCKET_IFNAME"] == "net0", e
    findings = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "network"]
    text = "\n".join(f"{f['status']} {f['message']} {f['fix']}" for f in findings)
    assert "is reached via interface net0" in text, text
    assert f"warn Gloo would bind to {DEAD_END}" in text, text
    assert "export GLOO_SOCKET_IFNAME=net0" in text, text


FINAL = re.compile(r"\[rank0\]: test accuracy (\d\.\d{4}) \((\d+)/360\) .* strategy ddp, 4 replica")


def test_c10d_rendezvous_on_the_first_node_trains_the_digits_demo(make_cluster, tmp_path: Path):
    cluster = make_cluster(2)
    args = [DIGITS, "--epochs", "3", "--ckpt", str(tmp_path / "ckpt"), "--log-dir",
            str(tmp_path / "logs")]  # fmt: skip
    launchers = jobs.start_job(cluster, args, tmp_path, nproc=2, rdzv="c10d", port=29400)
    codes = jobs.finish(launchers, timeout=400)
    assert codes == [0, 0], jobs.describe(launchers)
    found = FINAL.search(launchers[0].stdout) or FINAL.search(launchers[1].stdout)
    assert found, jobs.describe(launchers)
    assert float(found.group(1)) >= 0.9, found.group(0)
    # The store was hosted on node 0, whose address is the endpoint: nobody waited for it.
    assert "could not complete" not in launchers[0].stderr + launchers[1].stderr
