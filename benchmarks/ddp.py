"""rankwise DistributedDataParallel vs torch's, in the same processes, repeats interleaved.

    flock /tmp/rankwise-bench.lock python benchmarks/ddp.py --out ddp.json

World size 2 on gloo, one thread per process. For the reference MLP (10.5M parameters) and
the small CNN (``rankwise.bench.models``) it measures the step time (forward, loss, backward,
SGD step, zero_grad) of:

- ``rankwise`` and ``torch`` DDP, alternating which goes first in every repeat, and torch's
  with ``gradient_as_bucket_view=True`` (``torch_bucket_view``: no copy back into ``.grad``);
- ``rankwise_gloo``: rankwise with ``shared_memory_reduce=False``, every bucket through Gloo's
  all-reduce (what ranks on several machines, or without room in /dev/shm, get);
- ``single``: the bare model in one process (rank 0, the other rank idle) on the same per-rank
  batch, interleaved with the others, for scaling efficiency ``single / ddp`` (weak scaling:
  1.0 means two processes do twice the work in the same time);
- ``independent``: every rank trains its bare model with no communication at all: the best
  any DDP can do on this machine (with 2 cores, two processes already slow each other down);
- a bucket-size sweep (rankwise, MLP) and half-precision gradient compression (rankwise's
  ``compression='bf16'``/``'fp16'``; torch's ``fp16_compress_hook``, as its bf16 hook needs NCCL).

- ``loop_orders``: the three common places of ``zero_grad`` in a step (``first``: before the
  forward; ``after_forward``: the PyTorch tutorials' ``out = model(x); opt.zero_grad();
  loss.backward()``; ``last``: after ``opt.step()``), each with ``set_to_none`` True and False,
  on two MLP shapes (the reference MLP and a smaller, deeper-than-wide ``mlp_small``) and the
  CNN, rankwise (also ``rankwise_gloo``) vs torch side by side (``--part orders`` runs only
  this). Beside them, per order, ``independent`` (no communication) and, per model,
  ``all_reduce`` (the gradient buckets alone, through Gloo): their CPU times added, over
  torch's step time, are the floor (``loop_orders_floor_ratio_gloo_ddp_over_torch``) no
  implementation that sends the same bytes through Gloo can go below when the ranks' processes
  fill the machine's cores, however well it overlaps. Shared memory is below it: it sends
  nothing.

``loop_orders_paired_rankwise_over_torch``: per loop order, the geometric mean of rankwise/torch
repeat by repeat with its 99% interval, and on which side of the 0.70 target the interval lies
(``_paired``: ``faster`` below it, ``slower`` above it, ``even`` across it), and beside it
``verdict_vs_torch``, the same against torch's step (the CNN's target: parity).

``--pin``: every thread of rank r on core r (mod the cores), for rankwise and torch alike (what
DeepSpeed's ``--bind_cores_to_rank`` does); by default the kernel places the threads.

On a shared machine, ``chrt -r 10 python benchmarks/ddp.py ...`` (real-time priority, Linux,
root) keeps other jobs from delaying the ranks' wake-ups, which otherwise dominate wall-clock
ratios; CPU-time ratios are steadier either way.

Prints one JSON object (and writes it to ``--out``). Times are medians over repeats, in ms.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _paired import paired_ratio, side
from _report import emit

import rankwise as rw
from rankwise.bench import models
from rankwise.parallel.buckets import assign_buckets
from rankwise.parallel.ddp.node import shared_reduce
from rankwise.testing import run_distributed

ORDERS = ("first", "after_forward", "last")
SMALL_MLP = {"in_features": 512, "hidden": 1024, "depth": 4}  # 3.7M parameters, 5 layers


def _build(name: str) -> torch.nn.Module:
    return models.mlp(**SMALL_MLP) if name == "mlp_small" else models.build(name)


def _batch(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name != "mlp_small":
        return models.batch(name, size, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, SMALL_MLP["in_features"], generator=g)
    return x, torch.randint(0, 10, (size,), generator=g)


def _make(kind: str, name: str, **kw):
    torch.manual_seed(0)
    net = _build(name)
    if kind == "all_reduce":  # the model's gradient buckets, as rankwise lays them out
        params = [p for p in net.parameters() if p.requires_grad]
        return [torch.zeros(b.numel) for b in assign_buckets(params)]
    if kind == "shared_reduce":  # the same buckets through rankwise's shared memory, alone
        params = [p for p in net.parameters() if p.requires_grad]
        buckets = assign_buckets(params)
        shared = shared_reduce.attach(buckets, None, None)  # None: every bucket is small
        held = [b for b in range(len(buckets)) if shared is not None and shared.holds(b)]
        sources = {b: torch.randn(buckets[b].numel) for b in held}
        small = [torch.zeros(bk.numel) for b, bk in enumerate(buckets) if b not in held]
        return shared, sources, small  # the small buckets go through Gloo, as in the wrapper
    if kind == "rankwise":
        return rw.DistributedDataParallel(net, **kw)
    if kind == "rankwise_gloo":  # every bucket through Gloo's all-reduce, none shared
        return rw.DistributedDataParallel(net, shared_memory_reduce=False, **kw)
    if kind == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(
            net,
            bucket_cap_mb=kw.get("bucket_cap_mb"),
            gradient_as_bucket_view=kw.get("gradient_as_bucket_view", False),
        )
        if kw.get("compression") == "fp16":
            # torch's bf16_compress_hook refuses gloo (it needs NCCL); its fp16 hook runs.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp
    return net


def step(model, opt, x, y, order: str = "last", to_none: bool = True, after_backward=None) -> None:
    """One training step with ``zero_grad`` at ``order`` (``ORDERS``); ``after_backward()``, if
    given, runs as soon as ``backward()`` returns (``ddp_wait.py`` times it there)."""
    if order == "first":
        opt.zero_grad(set_to_none=to_none)
    out = model(x)
    if order == "after_forward":
        opt.zero_grad(set_to_none=to_none)
    F.cross_entropy(out, y).backward()
    if after_backward is not None:
        after_backward()
    opt.step()
    if order == "last":
        opt.zero_grad(set_to_none=to_none)


def _steps(model, opt, x, y, steps: int, order: str = "last", to_none: bool = True) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step(model, opt, x, y, order, to_none)
    return (time.perf_counter() - start) * 1000 / steps


def _all_reduce_steps(buffers: list[torch.Tensor], steps: int) -> float:
    """One step's worth of communication alone: every gradient bucket all-reduced, async."""
    start = time.perf_counter()
    for _ in range(steps):
        for work in [dist.all_reduce(b, async_op=True) for b in buffers]:
            work.wait()
    return (time.perf_counter() - start) * 1000 / steps


def _shared_reduce_steps(made, steps: int) -> float:
    """One step's worth of shared-memory reduction alone: every bucket put in this rank's slot
    (``torch.mul(grad, 1/world, out=slot)``, as a backward's hooks do), each chunk summed across
    the slots and copied into every slot, then the pass's fence."""
    shared, sources, small = made
    scale = 1.0 / dist.get_world_size()
    start = time.perf_counter()
    for _ in range(steps):
        works = [dist.all_reduce(buf, async_op=True) for buf in small]
        for b, src in sources.items():
            torch.mul(src, scale, out=shared.flat(b))
            works.append(shared.all_reduce(b))
        if sources:
            works.append(shared.fence())
        for work in works:
            work.wait()
    return (time.perf_counter() - start) * 1000 / steps


def _time(kind: str, model, opt, x, y, steps: int, order: str = "last", to_none=True) -> float:
    """Mean step time (ms) over ``steps`` steps; the slowest rank's for DDP.

    ``single`` runs on rank 0 only while the other ranks wait at a barrier (a blocking wait, not
    a busy one), so the one-process baseline is measured in the same run and under the same
    machine load as the DDP configurations it is interleaved with.
    """
    dist.barrier()
    cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if kind == "single":
        elapsed = _steps(model, opt, x, y, steps, order, to_none) if dist.get_rank() == 0 else 0.0
    elif kind == "all_reduce":
        elapsed = _all_reduce_steps(model, steps)
    elif kind == "shared_reduce":
        elapsed = _shared_reduce_steps(model, steps)
    else:
        elapsed = _steps(model, opt, x, y, steps, order, to_none)
    # CPU time (all threads of the process, Gloo's included) and page faults per step: less
    # sensitive than wall-clock time to other processes sharing the machine.
    cpu = (time.process_time() - cpu0) * 1000 / steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / steps
    t = torch.tensor([elapsed, cpu, faults])
    dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(t[1:], op=dist.ReduceOp.SUM)
    LAST_CPU_FAULTS[:] = [t[1].item() / dist.get_world_size(), t[2].item() / dist.get_world_size()]
    return t[0].item()


TARGET = 0.70
"""The loop orders' target: rankwise's step at most this share of torch's."""

LAST_CPU_FAULTS: list[float] = [0.0, 0.0]
"""Per-rank mean CPU ms and minor page faults per step of the last ``_time`` call."""


PIN = False
"""``--pin``: every thread of rank r on core r (mod the cores), for every implementation."""


def _pin(rank: int) -> None:
    core = sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]
    for tid in os.listdir("/proc/self/task"):  # Gloo's threads too, made at init
        os.sched_setaffinity(int(tid), {core})


def _compare(
    configs: dict[str, tuple[str, str, dict]],
    batch: int,
    steps: int,
    repeats: int,
    with_cpu: bool = False,
):
    """Interleave the configurations: every repeat runs each once, rotating the order."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if PIN:
        _pin(rank)
    built = {}
    for label, (kind, name, kw) in configs.items():
        loop = {k: kw.pop(k) for k in ("order", "to_none") if k in kw}
        model = _make(kind, name, **kw)
        opt = (None if kind in ("all_reduce", "shared_reduce")
               else torch.optim.SGD(model.parameters(), lr=0.01))  # fmt: skip
        x, y = _batch(name, batch, seed=rank)
        loop_args = (loop.get("order", "last"), loop.get("to_none", True))
        _time(kind, model, opt, x, y, 2, *loop_args)  # warm-up (and torch's bucket rebuild)
        built[label] = (kind, model, opt, x, y, steps, *loop_args)
    times: dict[str, list[float]] = {label: [] for label in configs}
    extra: dict[str, list[list[float]]] = {label: [] for label in configs}
    labels = list(configs)
    for r in range(repeats):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            times[label].append(_time(*built[label]))
            extra[label].append(list(LAST_CPU_FAULTS))
    if not with_cpu:
        return {label: round(statistics.median(v), 3) for label, v in times.items()}
    return {
        label: {
            "wall_ms": round(statistics.median(times[label]), 3),
            "cpu_ms": round(statistics.median(e[0] for e in extra[label]), 3),
            "page_faults": round(statistics.median(e[1] for e in extra[label])),
            "repeats_ms": [round(v, 3) for v in times[label]],  # in repeat order, for _paired
        }
        for label in configs
    }


def _orders_part(batch: int, steps: int, repeats: int) -> dict:
    """rankwise vs torch for every loop order, per model; one interleaved comparison each."""
    out = {}
    kinds = ("rankwise", "rankwise_gloo", "torch", "independent")
    loops = [(order, to_none) for order in ORDERS for to_none in (True, False)]
    for name in ("mlp", "mlp_small", "cnn"):
        # Built in a rotated order per loop order, so no kind is always built first: the same
        # code built twice measured up to 5% apart (benchmarks/shared_reduce_ab.py's control).
        configs = {
            f"{kind}/{order}/{'none' if to_none else 'zero'}": (
                kind,
                name,
                {"order": order, "to_none": to_none},
            )
            for i, (order, to_none) in enumerate(loops)
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
        }
        configs["all_reduce"] = ("all_reduce", name, {})
        configs["shared_reduce"] = ("shared_reduce", name, {})
        out[name] = _compare(configs, batch, steps, repeats, with_cpu=True)
    return out


def _orders(times: dict) -> list[str]:
    """The loop orders measured (``order/none|zero``), from the ``rankwise/...`` keys."""
    return sorted({k.split("/", 1)[1] for k in times if k.startswith("rankwise/")})


def _orders_table(res: dict, field: str = "wall_ms", kind: str = "rankwise") -> dict:
    """{model: {order/none|zero: ``kind``/torch ratio of ``field``}}."""
    table = {}
    for name, times in res.items():
        keys = _orders(times)
        table[name] = {
            k: round(times[f"{kind}/{k}"][field] / times[f"torch/{k}"][field], 3) for k in keys
        }
    return table


def _paired_table(res: dict, line: float) -> dict:
    """{model: {order/none|zero: rankwise/torch's 99% interval, repeat by repeat, and on which
    side of ``line`` it lies}} (``_paired``: repeat r of both ran in the same round)."""
    table = {}
    for name, times in res.items():
        keys = _orders(times)
        table[name] = {}
        for k in keys:
            pairs = times[f"rankwise/{k}"]["repeats_ms"], times[f"torch/{k}"]["repeats_ms"]
            row = table[name][k] = paired_ratio(*pairs, line=line)
            # against parity too: the CNN has no shared bucket, so 0.70 is not its target
            row["verdict_vs_torch"] = side(row["low"], row["high"], 1.0)
    return table


def _floor_table(res: dict, comm_row: str = "all_reduce") -> dict:
    """{model: {order/none|zero: the lowest step-time ratio to torch any DDP could reach}}.

    Two processes share two cores, so a step cannot take less wall-clock time than the CPU
    time each process must spend: its own forward, backward and optimizer step (the
    ``independent`` row, no communication) plus all-reducing its gradients (the
    ``all_reduce`` row, the same buckets alone). That sum over torch's step time bounds the
    ratio of any implementation that sends the same bytes, however well it overlaps. With
    ``comm_row="shared_reduce"``: the same for rankwise's shared-memory reduction, which sends
    nothing but must still copy, sum and gather every bucket (memory-bound CPU work).
    """
    table = {}
    for name, times in res.items():
        keys = _orders(times)
        comm = times[comm_row]["cpu_ms"]
        table[name] = {
            k: round(
                (times[f"independent/{k}"]["cpu_ms"] + comm) / times[f"torch/{k}"]["wall_ms"], 3
            )
            for k in keys
        }
    return table


def _distributed_part(
    batch: int, steps: int, repeats: int, sweep: list[float], part: str = "all", pin: bool = False
) -> dict:
    global PIN
    PIN = pin
    out: dict = {}
    if part in ("all", "orders"):
        out["loop_orders"] = _orders_part(batch, steps, max(2, repeats // 2))
    if part == "orders":
        return out
    for name in models.MODELS:
        out[name] = _compare(
            {
                "rankwise": ("rankwise", name, {}),
                "rankwise_gloo": ("rankwise_gloo", name, {}),
                "torch": ("torch", name, {}),
                "torch_bucket_view": ("torch", name, {"gradient_as_bucket_view": True}),
                "single": ("single", name, {}),
                "independent": ("independent", name, {}),
            },
            batch,
            steps,
            repeats,
        )
    few = max(2, repeats // 2)
    out["bucket_sweep_mlp"] = _compare(
        {f"{mb:g}MB": ("rankwise", "mlp", {"bucket_cap_mb": mb}) for mb in sweep}, batch, steps, few
    )
    out["compression_mlp"] = _compare(
        {
            "rankwise_fp32": ("rankwise", "mlp", {}),
            "rankwise_bf16": ("rankwise", "mlp", {"compression": "bf16"}),
            "rankwise_fp16": ("rankwise", "mlp", {"compression": "fp16"}),
            "torch_fp16": ("torch", "mlp", {"compression": "fp16"}),
        },
        batch,
        steps,
        few,
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=12, help="interleaved repeats")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sweep", default="1,5,25,100", help="bucket_cap_mb values (MiB)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--part", choices=["all", "orders"], default="all")
    parser.add_argument("--pin", action="store_true",
                        help="pin each rank's threads to one core of its own (all implementations)")
    args = parser.parse_args(argv)
    sweep = [float(v) for v in args.sweep.split(",")]
    run = (args.batch, args.steps, args.repeats, sweep, args.part)
    res = run_distributed(_distributed_part, args.world_size, args=(*run, args.pin),
                          timeout=900)[0]  # fmt: skip
    orders = {
        "loop_orders_ratio_rankwise_over_torch": _orders_table(res["loop_orders"]),
        "loop_orders_cpu_ratio_rankwise_over_torch": _orders_table(res["loop_orders"], "cpu_ms"),
        # The same ratio with its 99% interval over the repeats, against the 0.70 target
        "loop_orders_paired_rankwise_over_torch": _paired_table(res["loop_orders"], TARGET),
        "loop_orders_ratio_rankwise_gloo_over_torch": _orders_table(
            res["loop_orders"], kind="rankwise_gloo"
        ),
        "loop_orders_floor_ratio_gloo_ddp_over_torch": _floor_table(res["loop_orders"]),
        "loop_orders_floor_ratio_shared_ddp_over_torch": _floor_table(
            res["loop_orders"], "shared_reduce"
        ),
        # The no-communication ceiling: every rank training alone, over torch's DDP step.
        "loop_orders_ceiling_ratio_independent_over_torch": _orders_table(
            res["loop_orders"], kind="independent"
        ),
        "loop_orders_ms": res["loop_orders"],
        "pinned": args.pin,
        "load_avg_after": list(os.getloadavg()),
    }
    if args.part == "orders":
        return emit(orders, args.out)
    result: dict = {
        "benchmark": "ddp",
        "world_size": args.world_size,
        "backend": "gloo",
        "threads_per_process": 1,
        "per_rank_batch": args.batch,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "parameters": {n: models.num_parameters(models.build(n)) for n in models.MODELS},
        "step_ms": {n: res[n] for n in models.MODELS},
        "ratio_rankwise_over_torch": {
            n: round(res[n]["rankwise"] / res[n]["torch"], 3) for n in models.MODELS
        },
        "ratio_rankwise_gloo_over_torch": {
            n: round(res[n]["rankwise_gloo"] / res[n]["torch"], 3) for n in models.MODELS
        },
        "ratio_rankwise_over_torch_bucket_view": {
            n: round(res[n]["rankwise"] / res[n]["torch_bucket_view"], 3) for n in models.MODELS
        },
        "scaling_efficiency": {
            n: {
                k: round(res[n]["single"] / res[n][k], 3)
                for k in ("rankwise", "torch", "independent")
            }
            for n in models.MODELS
        },
        "bucket_sweep_mlp_ms": res["bucket_sweep_mlp"],
        "compression_mlp_ms": res["compression_mlp"],
        **orders,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
