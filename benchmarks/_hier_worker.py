"""One rank of benchmarks/hierarchical.py (``run_rank``), and the table it becomes (``summarise``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import statistics
import threading
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

CONFIGS = ("torch_ddp", "torch_ddp_view", "torch_ddp_hier_hook", "rankwise_flat",
           "rankwise_hierarchical", "independent")  # fmt: skip
TORCH = ("torch_ddp", "torch_ddp_view", "torch_ddp_hier_hook")
OURS = ("rankwise_flat", "rankwise_hierarchical")


class HierarchicalHook:
    """A torch DDP communication hook that reduces each bucket hierarchically: a sum within
    the node, an all-reduce between one rank per node, a broadcast within the node (Gloo
    groups made once). The three collectives of each bucket run on one worker thread, in the
    order DDP hands the buckets over (the same on every rank), so backward goes on meanwhile."""

    def __init__(self, per_node: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.world, node = world, rank // per_node
        self.leader = node * per_node
        self.is_leader = rank == self.leader
        self.node_group = self.leaders = None
        for n in range(world // per_node):  # every rank creates every group, in one order
            g = dist.new_group(list(range(n * per_node, (n + 1) * per_node)))
            if n == node:
                self.node_group = g
        self.leaders = dist.new_group(list(range(0, world, per_node)))
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, t: torch.Tensor) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self.jobs.put((t, fut))
        return fut

    def _run(self) -> None:
        while True:
            t, fut = self.jobs.get()
            try:
                t.div_(self.world)
                dist.all_reduce(t, group=self.node_group)
                if self.is_leader:
                    dist.all_reduce(t, group=self.leaders)
                dist.broadcast(t, src=self.leader, group=self.node_group)
                fut.set_result(t)
            except Exception as exc:  # handed to DDP, which raises it
                fut.set_exception(exc)


def hierarchical_hook(state, bucket):  # unannotated: torch refuses string annotations
    """torch's hook signature, state a ``HierarchicalHook``."""
    return state.submit(bucket.buffer())
SWEEP = tuple(2**k for k in range(16, 27, 2))  # 64 KiB .. 64 MiB


def _make(kind: str, per_node: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the model to step, the bare network whose parameters it trains)."""
    torch.manual_seed(0)
    net = models.mlp()
    if kind in TORCH:  # torch's best settings: gradients as bucket views, and with the hook
        view = kind != "torch_ddp"
        model = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view)
        if kind == "torch_ddp_hier_hook":
            model.register_comm_hook(HierarchicalHook(per_node), hierarchical_hook)
        return model, net
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
        model, net = _make(kind, args.per_node)
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
            for k in CONFIGS if k != "independent"}  # fmt: skip
    ref = digests["torch_ddp"][1]
    diff = {k: max((a - b).abs().max().item() for a, b in zip(ref, digests[k][1], strict=True))
            for k in CONFIGS[1:-1]}  # fmt: skip
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
    """Modelled steps; the compute term is the ``independent`` step of the same run."""
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
        c = med["independent"]
        checks[name] = {
            "network": net.to_dict(),
            "rankwise_flat": _err(pred["flat_ms"], med["rankwise_flat"], c),
            "torch_ddp": _err(pred["flat_ms"], med["torch_ddp"], c),
            "rankwise_hierarchical": _err(pred["hierarchical_ms"], med["rankwise_hierarchical"], c),
            "torch_ddp_hier_hook": _err(pred["hierarchical_ms"], med["torch_ddp_hier_hook"], c),
        }
    best_torch = min(TORCH, key=lambda k: med[k])
    ratio = med["rankwise_hierarchical"] / med[best_torch]
    worst = abs(checks["measured_link"]["rankwise_hierarchical"]["comm_error"])
    link_ms = m["gradient_bytes"] * link.beta_s_per_byte * 1e3
    return {
        "layout": f"2 nodes x {m['per_node']} processes, gloo, 1 thread each",
        "model": "mlp (10.5M parameters)",
        "batch_per_rank": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "link": shaping,
        "step_ms": med,
        "step_ms_min_max": spread,
        "best_torch": best_torch,
        "ratio_hierarchical_over_best_torch": round(ratio, 3),
        "ratio_hierarchical_over": {k: round(med["rankwise_hierarchical"] / med[k], 3)
                                    for k in TORCH},
        "ratio_flat_over_torch": round(med["rankwise_flat"] / med["torch_ddp"], 3),
        "ceiling": {
            "independent_over_best_torch": round(med["independent"] / med[best_torch], 3),
            "gradient_bytes_over_link_ms": round(link_ms, 1),
            "why": "no DDP step is shorter than the independent step (no communication); "
                   "gradient bytes / measured link bandwidth is what one copy of the gradients "
                   "costs on the link",
        },
        "rankwise_flat_path": m["rankwise_flat_path"],
        "replicas_bit_identical": m["replicas_bit_identical"],
        "max_abs_diff_vs_torch": m["max_abs_diff_vs_torch"],
        "link_sweep": m["sweep"],
        "bench_flags": f"--node-network {link.flag()} --ranks-per-node {m['per_node']}",
        "memcpy_GBps": m["memcpy_GBps"],
        "projection": {"model": "rankwise.bench.network.projection.predict_across_nodes (compute = "
                       "the independent step)", **checks},
        "targets": {
            "hierarchical_le_0.65x_best_torch": ratio <= 0.65,
            "projection_comm_within_15pct": worst <= 0.15,
        },
    }


def _err(pred: float, measured: float, compute: float) -> dict:
    """The projection's error on the whole step, and on communication alone (the step less
    the compute term, which is measured in the same run and so cannot be wrong)."""
    comm_pred, comm_meas = pred - compute, measured - compute
    return {"predicted_ms": round(pred, 2), "measured_ms": measured,
            "error": round((pred - measured) / measured, 3),
            "comm_predicted_ms": round(comm_pred, 2), "comm_measured_ms": round(comm_meas, 2),
            "comm_error": round((comm_pred - comm_meas) / comm_meas, 3) if comm_meas > 0 else None}  # fmt: skip
