"""One rank of benchmarks/hierarchical.py (``run_rank``), and the table it becomes (``summarise``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import rankwise as rw
from rankwise.bench import models
from rankwise.bench.network import projection
from rankwise.bench.network.commbench import memcpy_gbps
from rankwise.comm import wire
from rankwise.parallel.ddp.node.hierarchical import HierarchicalBuckets

CONFIGS = ("torch_ddp", "rankwise_flat", "rankwise_hierarchical", "independent")
SWEEP = tuple(2**k for k in range(16, 27, 2))  # 64 KiB .. 64 MiB


def _make(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model to step, the bare network whose parameters it trains)."""
    torch.manual_seed(0)
    net = models.mlp()
    if kind == "torch_ddp":
        return torch.nn.parallel.DistributedDataParallel(net), net
    if kind == "rankwise_flat":
        return rw.DistributedDataParallel(net, hierarchical_reduce=False), net
    if kind == "rankwise_hierarchical":
        model = rw.DistributedDataParallel(net)
        if not isinstance(model.reducer.shared, HierarchicalBuckets):
            raise RuntimeError("rankwise DDP did not choose the hierarchical path across nodes")
        return model, net
    return net, net


def _timed(model, opt, batches, steps: int) -> float:
    """Mean ms per step, slowest rank. Sync point: all ranks."""
    dist.barrier()
    start = time.perf_counter()
    for k in range(steps):
        x, y = batches[k % len(batches)]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    t = torch.tensor([(time.perf_counter() - start) * 1e3 / steps])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sweep(per_node: int) -> list[dict]:
    """All-reduce latency between one rank per node (ranks 0 and per_node): the link alone."""
    pair = dist.new_group([0, per_node])
    rows = []
    for size in SWEEP:
        t = torch.ones(size // 4)
        samples = []
        for rep in range(4):
            dist.barrier()
            if dist.get_rank() in (0, per_node):
                start = time.perf_counter()
                dist.all_reduce(t, group=pair)
                if rep:  # the first one opens the connection's window
                    samples.append(time.perf_counter() - start)
        got = torch.tensor([statistics.median(samples) if samples else 0.0])
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        rows.append({"bytes": size, "latency_us": round(got.item() * 1e6, 1)})
    return rows


def _digest(net: torch.nn.Module) -> tuple[str, list[torch.Tensor]]:
    params = [p.detach().clone() for p in net.parameters()]
    h = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()
    return h, params


def run_rank(args: argparse.Namespace) -> None:
    """Time every configuration, sweep the link, check the replicas; rank 0 writes JSON."""
    rw.init()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, 1024, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(4)]  # fmt: skip
    built = {}
    for kind in CONFIGS:
        model, net = _make(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        _timed(model, opt, batches, 2)  # warm-up (and torch's bucket rebuild)
        built[kind] = (model, net, opt)
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    for r in range(args.repeats):
        for kind in CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]:
            model, _, opt = built[kind]
            times[kind].append(round(_timed(model, opt, batches, args.steps), 3))
    digests = {k: _digest(built[k][1]) for k in CONFIGS}
    same = {k: len(set(wire.all_gather_json(digests[k][0], label="digest"))) == 1
            for k in CONFIGS[:3]}  # fmt: skip
    ref = digests["torch_ddp"][1]
    diff = {k: max((a - b).abs().max().item() for a, b in zip(ref, digests[k][1], strict=True))
            for k in ("rankwise_flat", "rankwise_hierarchical")}  # fmt: skip
    flat_path = "gloo" if built["rankwise_flat"][0].reducer.shared is None else "shared memory"
    out = {
        "times_ms": times,
        "sweep": _sweep(args.per_node),
        "memcpy_GBps": round(memcpy_gbps(torch.device("cpu")), 3),
        "replicas_bit_identical": same,
        "max_abs_diff_vs_torch": diff,
        "rankwise_flat_path": flat_path,
        "gradient_bytes": sum(p.numel() * 4 for p in built["independent"][1].parameters()),
        "world_size": dist.get_world_size(),
        "per_node": args.per_node,
    }
    if rank == 0:
        Path(args.worker).write_text(json.dumps(out))
    dist.barrier()


def _predictions(m: dict, net: projection.Network, compute_ms: float) -> dict:
    nodes, per_node, grad = m["world_size"] // m["per_node"], m["per_node"], m["gradient_bytes"]
    copy = m["memcpy_GBps"] * 1e9
    flat = projection.predict_across_nodes(compute_ms / 1e3, grad, nodes, per_node, net, copy,
                                           hierarchical=False)  # fmt: skip
    hier = projection.predict_across_nodes(compute_ms / 1e3, grad, nodes, per_node, net, copy,
                                           hierarchical=True)  # fmt: skip
    return {"flat_ms": flat["step_ms"], "hierarchical_ms": hier["step_ms"]}


def summarise(m: dict, shaping: dict, args: argparse.Namespace) -> dict:
    """The measured table, the ratios, the projection's errors and the targets."""
    med = {k: round(statistics.median(v), 3) for k, v in m["times_ms"].items()}
    spread = {k: [min(v), max(v)] for k, v in m["times_ms"].items()}
    link = projection.fit_ring(m["sweep"], 2)
    nominal = projection.parse_network(
        f"{shaping['rate'].replace('bit', 'bps')},{(shaping.get('delay') or '0ms')}"
    )
    checks = {}
    for name, net in (("measured_link", link), ("nominal_link", nominal)):
        pred = _predictions(m, net, med["independent"])
        checks[name] = {
            "network": net.to_dict(),
            "rankwise_flat": _err(pred["flat_ms"], med["rankwise_flat"]),
            "torch_ddp": _err(pred["flat_ms"], med["torch_ddp"]),
            "rankwise_hierarchical": _err(pred["hierarchical_ms"], med["rankwise_hierarchical"]),
        }
    ratio = med["rankwise_hierarchical"] / med["torch_ddp"]
    worst = max(abs(checks["measured_link"]["rankwise_hierarchical"]["error"]), 0)
    return {
        "layout": f"2 nodes x {m['per_node']} processes, gloo, 1 thread each",
        "model": "mlp (10.5M parameters)",
        "batch_per_rank": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "link": shaping,
        "step_ms": med,
        "step_ms_min_max": spread,
        "ratio_hierarchical_over_torch": round(ratio, 3),
        "ratio_flat_over_torch": round(med["rankwise_flat"] / med["torch_ddp"], 3),
        "rankwise_flat_path": m["rankwise_flat_path"],
        "replicas_bit_identical": m["replicas_bit_identical"],
        "max_abs_diff_vs_torch": m["max_abs_diff_vs_torch"],
        "link_sweep": m["sweep"],
        "bench_flags": f"--node-network {link.flag()} --ranks-per-node {m['per_node']}",
        "memcpy_GBps": m["memcpy_GBps"],
        "projection": {"model": "rankwise.bench.network.projection.predict_across_nodes (compute = "
                       "the independent step)", **checks},
        "targets": {
            "hierarchical_le_0.75x_torch": ratio <= 0.75,
            "projection_within_15pct": worst <= 0.15,
        },
    }


def _err(pred: float, measured: float) -> dict:
    return {"predicted_ms": round(pred, 2), "measured_ms": measured,
            "error": round((pred - measured) / measured, 3)}  # fmt: skip
