"""Two network namespaces as two hosts, 2 processes each, joined by a real veth link: the job
that ``rankwise run --nnodes 2`` starts reduces its gradients node first, and trains as the
flat path does.

Each node also has its own /dev/shm (``benchmarks/_twonodes.py``: a mount namespace with a
private tmpfs), as two machines would: the flat path cannot share memory across them. Needs
root, ``ip``, ``tc`` and ``unshare``; skipped with the reason otherwise. The namespaces are
ours and removed afterwards.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from .test_launch import finish, reports, start

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _twonodes import TwoNodes, Unavailable, unavailable

TRAIN = textwrap.dedent("""
    # Trains rt.prepare's DDP (as it comes, and flat) and ZeRO stage 2 on this rank's batches;
    # writes the engines' choices and the parameters to OUT/rank<R>.json.
    import json, os, sys
    import torch, torch.nn.functional as F
    from torch import nn
    import rankwise as rw
    from rankwise.parallel.ddp.node.hierarchical import HierarchicalBuckets

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 4))

    def train(model, opt):
        g = torch.Generator().manual_seed(10 + rt.rank)
        for _ in range(3):
            x, y = torch.randn(8, 512, generator=g), torch.randint(0, 4, (8,), generator=g)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return [v.tolist() for v in model.state_dict().values()]

    rt = rw.init(strategy="ddp")
    bare = net()
    model, opt = rt.prepare(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    report = {"ddp_hier": isinstance(model.reducer.shared, HierarchicalBuckets),
              "ddp": train(model, opt)}
    flat = rw.DistributedDataParallel(net(), hierarchical_reduce=False)
    report["flat_path"] = type(flat.reducer.shared).__name__
    report["flat"] = train(flat, torch.optim.SGD(flat.parameters(), lr=0.1))
    inner = net()
    zero = rw.ShardedDataParallel(inner, torch.optim.SGD(inner.parameters(), lr=0.1), stage=2)
    report["zero_hier"] = zero.units[0].lane is not None
    report["zero"] = train(zero, zero.optimizer)
    report["ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")
    with open(os.path.join(sys.argv[1], f"rank{rt.rank}.json"), "w") as f:
        json.dump(report, f)
    rw.shutdown()
""")


@pytest.fixture
def two_nodes():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with TwoNodes(shm_size="256m") as nodes:
            yield nodes
    except Unavailable as exc:
        pytest.skip(f"cannot build two network namespaces here: {exc}")


def test_two_nodes_reduce_node_first_and_train_as_the_flat_path(two_nodes, tmp_path: Path):
    (tmp_path / "train.py").write_text(TRAIN)
    common = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--master-addr",
              two_nodes.addr[0], "--master-port", "29531", "--rdzv-timeout", "90"]  # fmt: skip
    procs = []
    for i in (1, 0):
        argv = (*common, "--node-rank", str(i), "train.py", str(tmp_path))
        procs.append(start(*argv, cwd=tmp_path, prefix=tuple(two_nodes.prefix(i))))
    for proc in procs:
        code, _, stderr = finish(proc, timeout=300)
        assert code == 0, stderr
    rep = reports(tmp_path)
    assert sorted(rep) == [0, 1, 2, 3]
    for rank, r in rep.items():
        assert r["ddp_hier"] and r["zero_hier"]
        assert r["flat_path"] == "NoneType"  # no shared memory across the two hosts: Gloo
        assert r["ifname"] == two_nodes.ifname[rank // 2]
        assert r["ddp"] == rep[0]["ddp"] and r["zero"] == rep[0]["zero"]  # bit-identical
        for ours, flat in zip(r["ddp"], r["flat"], strict=True):
            assert np.allclose(ours, flat, rtol=1e-5, atol=1e-6)
        for ours, flat in zip(r["zero"], r["flat"], strict=True):
            assert np.allclose(ours, flat, rtol=1e-5, atol=1e-6)


def test_bench_comm_launched_on_two_nodes_measures_the_shaped_link(two_nodes, tmp_path: Path):
    shaping = two_nodes.shape("100mbit", None)  # a token bucket, or netem where there is one
    common = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", two_nodes.addr[0],
              "--master-port", "29532", "--rdzv-timeout", "90"]  # fmt: skip
    bench = ["-m", "rankwise", "bench", "comm", "--comm-max-bytes", str(2**20), "--repeats", "3"]
    procs = []
    for i in (1, 0):
        argv = (*common, "--node-rank", str(i), *bench, "--out", str(tmp_path / f"node{i}"))
        procs.append(start(*argv, cwd=tmp_path, prefix=tuple(two_nodes.prefix(i))))
    for proc in procs:
        code, _, stderr = finish(proc, timeout=300)
        assert code == 0, stderr
    assert not (tmp_path / "node1" / "comm.json").exists()  # rank 0 reports
    report = json.loads((tmp_path / "node0" / "comm.json").read_text())
    assert report["world_size"] == 2 and shaping["rate"] == "100mbit"
    big = report["rows"][-1]  # 1 MiB: a ring of two sends it once each way, at <= 100 Mbit/s
    assert big["bytes"] == 2**20 and big["algbw_GBps"] * 8 < 0.1 * 1.15
    # The fit (for --node-network) is the shaped link's, not the loopback's (10+ Gbit/s); how
    # close it lands to 100 Mbit/s swings with the machine's load.
    assert 0 < report["fit"]["bandwidth_GBps"] * 8 < 0.2, report["fit"]
