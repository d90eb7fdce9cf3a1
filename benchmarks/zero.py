"""Sharded data parallel (ZeRO 1/2/3) vs DDP, torch's ZeroRedundancyOptimizer and FSDP2.

    flock /tmp/bench.lock python benchmarks/zero.py --world 2 --params 50 --world 4 --params 12
    flock /tmp/rw-bench.lock python benchmarks/zero.py --world 2 --params 25 --batch 64 \
        --strategies zero3,zero3-p0,zero3-p2,torch-fsdp2,torch-fsdp2-prefetch,alone \
        --repeats 5 --steps 5 --out benchmarks/results/zero3_prefetch_b64.json

One spawned group per ``--world``/``--params`` pair (an MLP of 2048-wide layers with about that
many million parameters, AdamW, fp32). In each rank, one strategy after another, fresh:

- ``ddp`` (ours), ``zero1``, ``zero2``, ``zero3`` (ours), ``torch-zero1`` (torch's
  ``ZeroRedundancyOptimizer`` over torch's DDP), ``torch-fsdp2`` (``fully_shard`` per layer);
- on request: ``zero3-p0`` / ``zero3-p2`` (stage 3 with prefetch off / two layers ahead;
  ``zero3`` is the default, one ahead), ``torch-fsdp2-prefetch`` (FSDP2 with its explicit
  forward and backward prefetch, one block ahead) and ``alone``, the no-communication
  ceiling: every rank trains the bare model on its own batch, nothing sent. With ``zero3`` and ``torch-fsdp2`` in
  the run, the JSON's ``ratios`` give each stage-3 row over FSDP2 and over the ceiling;
- **state MB**: what the rank holds after a step, counted from the tensors: parameters
  resident between steps, gradients, optimizer state (AdamW's two moments);
- **peak MB**: the rank's resident-set high-water mark over the timed steps, above what the
  process held before the model was built (``VmHWM`` reset with ``/proc/self/clear_refs``;
  allocations over 1 MiB served by mmap, so freed memory leaves the count at once). It
  includes activations and communication buffers. CPU (Gloo) only;
- **step ms**: median wall time of forward, backward, ``step`` and ``zero_grad`` (``--repeats``
  runs every strategy that many times, interleaved; the median of the repeats' medians).

Prints one JSON object and writes ``benchmarks/results/zero.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rankwise as rw
from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.testing import run_distributed

WIDTH = 2048
BATCH = 8
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "torch-zero1", "torch-fsdp2")
EXTRA = ("zero3-p0", "zero3-p2", "torch-fsdp2-prefetch", "alone")
"""Run only when named in ``--strategies`` (prefetch off / deeper, the no-communication step)."""


def _model(million: float) -> nn.Module:
    layers = max(1, round(million * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _build(name: str, million: float):
    """(model to call, optimizer, tensors that are optimizer state, gradient tensors)."""
    net = _model(million)
    if name == "ddp":
        model = rw.DistributedDataParallel(net)
        return model, _adamw(net.parameters())
    if name == "alone":
        return net, _adamw(net.parameters())
    if name.startswith("zero"):
        stage, _, depth = name.removeprefix("zero").partition("-p")
        extra = {"prefetch": int(depth)} if depth else {}
        model = rw.ShardedDataParallel(net, _adamw, stage=int(stage), **extra)
        return model, model.optimizer
    if name == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = torch.nn.parallel.DistributedDataParallel(net)
        return model, ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in net:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    if name == "torch-fsdp2-prefetch":  # its public explicit prefetch, one block ahead
        blocks = list(net)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0) : i])
    return net, _adamw(net.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _mb(tensors) -> float:
    seen, total = set(), 0
    for t in tensors:
        t = _local(t)
        if t is None or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return round(total / 2**20, 1)


def _state_mb(name: str, model: nn.Module, opt) -> dict[str, float]:
    inner = getattr(opt, "optim", None) or getattr(opt, "inner", None) or opt
    states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    if name.startswith("zero"):
        params = [u.full for u in model.units] + [u.shard for u in model.units]
        grads = [u.shard.grad for u in model.units] + [p.grad for p in model.params]
        grads += [u.grad_full for u in model.units]
    else:
        params = list(model.parameters())
        grads = [p.grad for p in model.parameters()]
    return {
        "params_mb": _mb(params),
        "grads_mb": _mb(g for g in grads if g is not None),
        "optimizer_mb": _mb(states),
    }


def _step(model, opt, x, y, keep_grads: bool = False) -> None:
    F.mse_loss(model(x), y).backward()
    opt.step()
    if not keep_grads:
        opt.zero_grad(set_to_none=False)


def _one(name: str, million: float, steps: int, batch: int) -> dict:
    rank = dist.get_rank()
    gc.collect()
    _trim_heap()
    base_kb = _status_kb("VmRSS")
    model, opt = _build(name, million)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g)
    _step(model, opt, x, y)  # optimizer state exists from here on
    _step(model, opt, x, y)
    state = _state_mb(name, model, opt)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := now
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, x, y)
        times.append((time.perf_counter() - t0) * 1e3)
    peak_mb = (_status_kb("VmHWM") - base_kb) / 1024
    del model, opt
    return {"step_ms": round(statistics.median(times), 1), "peak_mb": round(peak_mb, 1), **state}


def _exact_rss() -> None:
    """Serve every allocation over 1 MiB with mmap, so freed tensors leave the resident set at
    once. Left to itself glibc raises that threshold as large blocks are freed, then keeps
    them in its heap: stage 3's freed parameters would still count (same for every row)."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _group(million: float, steps: int, names: list[str], repeats: int, batch: int) -> dict:
    torch.set_num_threads(1)
    _exact_rss()
    params = sum(p.numel() for p in _model(million).parameters())
    out: dict = {"params_m": round(params / 1e6, 2), "world": dist.get_world_size(),
                 "batch_per_rank": batch, "load_before": os.getloadavg()}  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeats):  # interleaved, the order reversed every other repeat
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(_one(name, million, steps, batch))
    out["load_after"] = os.getloadavg()
    for name, rows in runs.items():
        out[name] = {**rows[0], "peak_mb": max(row["peak_mb"] for row in rows)}
        out[name]["step_ms"] = round(statistics.median(row["step_ms"] for row in rows), 1)
        out[name]["step_ms_repeats"] = [row["step_ms"] for row in rows]
    return out


def _table(results: list[dict]) -> str:
    cols = ("step_ms", "peak_mb", "params_mb", "grads_mb", "optimizer_mb")
    lines = []
    for res in results:
        lines.append(f"world {res['world']}, {res['params_m']}M parameters, AdamW fp32 "
                     "(per rank: max over ranks)")  # fmt: skip
        lines.append(f"{'strategy':<13}" + "".join(f"{c:>14}" for c in cols))
        for name in STRATEGIES + EXTRA:
            if name in res:
                row = res[name]
                lines.append(f"{name:<13}" + "".join(f"{row[c]:>14}" for c in cols))
    return "\n".join(lines)


def _merge(per_rank: list[dict]) -> dict:
    merged = {k: v for k, v in per_rank[0].items() if not isinstance(v, dict)}
    for name in (k for k, v in per_rank[0].items() if isinstance(v, dict)):
        merged[name] = {c: max(r[name][c] for r in per_rank) for c in per_rank[0][name]}
        merged[name]["per_rank_peak_mb"] = [r[name]["peak_mb"] for r in per_rank]
    ratios = _ratios(merged)
    if ratios:
        merged["ratios"] = ratios
    return merged


def _ratios(res: dict) -> dict[str, float]:
    """Each stage-3 row's step over FSDP2's and over the no-communication ceiling (``alone``),
    with FSDP2's over the ceiling beside: how far from free communication both are."""
    out = {}
    peer, ceiling = res.get("torch-fsdp2"), res.get("alone")
    for name in ("zero3", "zero3-p0", "zero3-p2", "torch-fsdp2", "torch-fsdp2-prefetch"):
        if name not in res:
            continue
        ms = res[name]["step_ms"]
        if peer is not None and not name.startswith("torch"):
            out[f"{name}/torch-fsdp2"] = round(ms / peer["step_ms"], 3)
        if ceiling is not None:
            out[f"{name}/alone"] = round(ms / ceiling["step_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, action="append", help="world size (repeatable)")
    ap.add_argument("--params", type=float, action="append", help="million parameters, per --world")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats per strategy")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help=f"comma-separated, of {', '.join(STRATEGIES + EXTRA)}")
    ap.add_argument("--batch", type=int, default=BATCH, help="rows per rank per step")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero.json"))
    args = ap.parse_args()
    worlds, sizes = args.world or [2], args.params or [50.0]
    names = [s for s in args.strategies.split(",") if s]
    results = []
    for world, million in zip(worlds, sizes, strict=True):
        per_rank = run_distributed(_group, world, timeout=3000,
                                   args=(million, args.steps, names, args.repeats, args.batch))
        results.append(_merge(per_rank))
        print(_table(results[-1:]), flush=True)
        print(json.dumps(results[-1].get("ratios", {})), flush=True)
    doc = {"benchmark": "zero", "load_note": "2 shared CPU cores, taken under load",
           "results": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
