"""The recipes (docs/recipes.md) against torch's own: step time and peak memory per rank.

    flock /tmp/rankwise-bench.lock python benchmarks/recipes.py            # GPT-2, world 2
    python benchmarks/recipes.py --quick                                    # a smaller run
    python benchmarks/recipes.py --recipes gpt2,nanogpt,resnet18 --batch 4 --batch 16

World 2 on Gloo (CPU), one thread per rank, fp32, AdamW (one parameter group: the form every
engine here takes today). In one spawned job, per recipe and per-rank batch, each rank builds
every strategy fresh, one after another:

- ours: ``ddp`` (``rw.DistributedDataParallel``), ``zero1``, ``zero2``, ``zero3``
  (``rw.ShardedDataParallel``; stage 3's unit is one transformer or residual block,
  ``unit_numel`` set to a block's size, as FSDP2 is wrapped below); on request ``ddp-gloo``,
  ``zero1-gloo``, ``zero3-gloo``: the same without shared memory between the ranks, every
  collective through Gloo as torch's (stage 3 then gathers each block before it computes);
- torch's: ``torch-ddp`` (``DistributedDataParallel``), ``torch-zero1``
  (``ZeroRedundancyOptimizer`` over torch's DDP), ``torch-fsdp2`` (``fully_shard`` on every
  block, then the root).

Columns, per strategy, the worse of the two ranks:

- **step_ms**: median wall time of forward, loss, backward, ``step`` and ``zero_grad``
  (``--repeats`` runs every strategy that many times, interleaved, the order reversed every
  other repeat; the median of the repeats' medians). **cpu_ms**: the same step's process CPU
  time (steadier than wall time on a shared machine; Gloo's threads count);
- **peak_mb**: the rank's resident-set high-water mark over the timed steps, above what the
  process held before the model was built (``VmHWM`` reset through ``/proc/self/clear_refs``;
  allocations over 1 MiB served by mmap, so freed memory leaves the count at once). It holds
  parameters, gradients, optimizer state, activations and communication buffers. The
  resident set counts a shared page in every process that touches it (ours: ddp's
  shared-memory gradient buckets, read by both ranks); **pss_mb** is the proportional set
  size after the timed steps, above the same start (shared pages split between the ranks).

``independent`` (the ceiling): every rank trains the bare model alone, no communication; no
engine's step can be shorter, and each target pair prints its ratio to it beside the ratio.

The ``targets`` block compares the pairs the project holds itself to: ddp / torch-ddp <= 0.85,
zero1 / torch-zero1 <= 1.0, zero3 / torch-fsdp2 <= 0.8 in step time, each with a peak no higher
than the peer's. Prints one JSON object and writes ``benchmarks/results/recipes.json`` (or
``--out``); figures taken while other jobs run are noisy: the JSON says what the load was.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
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

from _report import emit

import rankwise as rw
from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.models import GPT, GPTConfig, resnet18
from rankwise.testing import run_distributed

OURS = ("ddp", "zero1", "zero2", "zero3")
GLOO = ("ddp-gloo", "zero1-gloo", "zero3-gloo")
"""On request: ours without shared memory between the ranks (every collective through Gloo)."""
PEERS = ("torch-ddp", "torch-zero1", "torch-fsdp2")
CEILING = "independent"  # the same step with no communication: every rank trains alone
TARGETS = {"ddp": ("torch-ddp", 0.85), "zero1": ("torch-zero1", 1.0),
           "zero3": ("torch-fsdp2", 0.8)}  # fmt: skip


def _sizes(quick: bool) -> dict:
    if quick:
        return {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab": 2048, "seq": 64}
    return {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 8192, "seq": 128}


def _build(recipe: str, quick: bool) -> tuple[nn.Module, list[nn.Module]]:
    """(model, its blocks: FSDP2's units and the size of ours); the same weights on every rank."""
    s = _sizes(quick)
    torch.manual_seed(0)
    if recipe == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=s["vocab"], n_positions=s["seq"], n_embd=s["n_embd"],
                         n_layer=s["n_layer"], n_head=s["n_head"], resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = GPT2LMHeadModel(cfg)
        return model, list(model.transformer.h)
    if recipe == "nanogpt":
        model = GPT(GPTConfig(vocab_size=s["vocab"], block_size=s["seq"], n_layer=s["n_layer"],
                              n_head=s["n_head"], n_embd=s["n_embd"]))  # fmt: skip
        return model, list(model.blocks)
    model = resnet18(num_classes=100, width=16 if quick else 32)
    return model, [m for m in model.modules() if type(m).__name__ == "BasicBlock"]


def _batch(recipe: str, batch: int, quick: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = _sizes(quick)
    g = torch.Generator().manual_seed(dist.get_rank())
    if recipe == "resnet18":
        x = torch.randn(batch, 3, 32, 32, generator=g)
        return x, torch.randint(0, 100, (batch,), generator=g)
    ids = torch.randint(0, s["vocab"], (batch, s["seq"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss(recipe: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if recipe == "gpt2":
        return model(input_ids=x, labels=x).loss
    if recipe == "nanogpt":
        return model(x, y)[1]
    return F.cross_entropy(model(x), y)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def _wrap(name: str, model: nn.Module, blocks: list[nn.Module]):
    """(the model to call, its optimizer) for strategy ``name``."""
    if name == CEILING:
        return model, _adamw(model.parameters())
    if name in ("ddp", "ddp-gloo"):  # ddp-gloo: every bucket through Gloo, no shared memory
        shared = None if name == "ddp" else False
        wrapped = rw.DistributedDataParallel(model, shared_memory_reduce=shared)
        return wrapped, _adamw(model.parameters())
    if name.startswith("zero"):  # zero1-gloo, zero3-gloo: no shared memory between the ranks
        unit = min(sum(p.numel() for p in b.parameters()) for b in blocks)
        shared = False if name.endswith("-gloo") else None
        engine = rw.ShardedDataParallel(model, _adamw, stage=int(name[4]), unit_numel=unit,
                                        shared_memory=shared)  # fmt: skip
        return engine, engine.optimizer
    if name == "torch-ddp":
        return torch.nn.parallel.DistributedDataParallel(model), _adamw(model.parameters())
    if name == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        zro = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4,
                                      weight_decay=0.1)  # fmt: skip
        return wrapped, zro
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh), _adamw(model.parameters())


def _step(recipe: str, model, opt, x, y) -> None:
    _loss(recipe, model, x, y).backward()
    opt.step()
    opt.zero_grad()


def _pss_mb() -> float:
    """Proportional set size: a page shared by two processes counts half in each."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024


def _one(recipe: str, name: str, batch: int, steps: int, quick: bool) -> dict:
    _trim_heap()
    base_kb, base_pss = _status_kb("VmRSS"), _pss_mb()
    model, opt = _wrap(name, *_build(recipe, quick))
    x, y = _batch(recipe, batch, quick)
    for _ in range(2):  # optimizer state, buffers and first-call caches exist from here on
        _step(recipe, model, opt, x, y)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := now
    wall, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        _step(recipe, model, opt, x, y)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    peak = (_status_kb("VmHWM") - base_kb) / 1024
    pss = _pss_mb() - base_pss
    del model, opt
    return {"step_ms": statistics.median(wall), "cpu_ms": statistics.median(cpu),
            "peak_mb": peak, "pss_mb": pss}  # fmt: skip


def _exact_rss() -> None:
    """Allocations over 1 MiB through mmap: freed tensors leave the resident set at once
    (glibc would otherwise keep them in its heap, and stage 3's freed parameters would count)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _job(recipes: list[str], batches: list[int], names: list[str], steps: int, repeats: int,
         quick: bool) -> dict:  # fmt: skip
    torch.set_num_threads(1)
    _exact_rss()
    out: dict = {}
    for recipe in recipes:
        model, _ = _build(recipe, quick)
        params = sum(p.numel() for p in model.parameters())
        for batch in batches:
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for r in range(repeats):  # interleaved, the order reversed every other repeat
                for name in names if r % 2 == 0 else names[::-1]:
                    runs[name].append(_one(recipe, name, batch, steps, quick))
            row = {"params_m": round(params / 1e6, 2), "batch_per_rank": batch}
            for name, rows in runs.items():
                row[name] = {k: round(statistics.median(r[k] for r in rows), 1)
                             for k in ("step_ms", "cpu_ms")}  # fmt: skip
                for k in ("peak_mb", "pss_mb"):
                    row[name][k] = round(max(r[k] for r in rows), 1)
            out[f"{recipe}/b{batch}"] = row
    return out


def _merge(ranks: list[dict]) -> dict:
    """The worse rank per figure; the targets' ratios from those."""
    merged = {}
    for key, row in ranks[0].items():
        m = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for name in (k for k, v in row.items() if isinstance(v, dict)):
            m[name] = {c: max(r[key][name][c] for r in ranks) for c in row[name]}
        targets = {}
        for ours, (peer, bound) in TARGETS.items():
            if ours in m and peer in m:
                ratio = m[ours]["step_ms"] / m[peer]["step_ms"]
                targets[f"{ours}/{peer}"] = {
                    "step_ratio": round(ratio, 3),
                    "cpu_ratio": round(m[ours]["cpu_ms"] / m[peer]["cpu_ms"], 3),
                    "target": bound,
                    "time_met": ratio <= bound,
                    "memory_met": m[ours]["peak_mb"] <= m[peer]["peak_mb"],
                    "pss_ratio": round(m[ours]["pss_mb"] / m[peer]["pss_mb"], 3),
                }
                if CEILING in m:  # printed beside: the step with no communication
                    c = m[CEILING]["step_ms"]
                    targets[f"{ours}/{peer}"]["ceiling"] = {
                        "ours_over_ceiling": round(m[ours]["step_ms"] / c, 3),
                        "peer_over_ceiling": round(m[peer]["step_ms"] / c, 3),
                        "ceiling_over_peer": round(c / m[peer]["step_ms"], 3),
                    }
        m["targets"] = targets
        merged[key] = m
    return merged


def _table(merged: dict) -> str:
    lines = []
    for key, row in merged.items():
        lines.append(f"{key}: {row['params_m']}M parameters, {row['batch_per_rank']} per rank "
                     "(worse rank)")  # fmt: skip
        cols = ("step_ms", "cpu_ms", "peak_mb", "pss_mb")
        lines.append(f"  {'strategy':<12}" + "".join(f"{c:>10}" for c in cols))
        for name in (*OURS, *GLOO, *PEERS, CEILING):
            if name in row:
                lines.append(f"  {name:<12}" + "".join(f"{row[name][c]:>10}" for c in cols))
        for pair, t in row["targets"].items():
            ceiling = t.get("ceiling")
            beside = ("" if ceiling is None else f"; the no-communication step is "
                      f"{ceiling['ceiling_over_peer']}x the peer's, ours "
                      f"{ceiling['ours_over_ceiling']}x it")  # fmt: skip
            lines.append(f"  {pair}: {t['step_ratio']}x wall, {t['cpu_ratio']}x cpu "
                         f"(target <= {t['target']}; time met {t['time_met']}, "
                         f"memory met {t['memory_met']}, pss {t['pss_ratio']}x{beside})")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="gpt2", help="comma-separated: gpt2,nanogpt,resnet18")
    ap.add_argument("--batch", type=int, action="append", help="per-rank batch (repeatable)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats per strategy")
    ap.add_argument("--strategies", default=",".join((*OURS, *PEERS, CEILING)))
    ap.add_argument("--quick", action="store_true", help="a smaller model, 3 steps, 1 repeat")
    ap.add_argument("--note", default="", help="what else ran on the machine (kept in the JSON)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/recipes[-quick].json")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1
    recipes = [r for r in args.recipes.split(",") if r]
    batches = args.batch or [8]
    names = [s for s in args.strategies.split(",") if s]
    t0, load_before = time.perf_counter(), os.getloadavg()
    ranks = run_distributed(_job, 2, args=(recipes, batches, names, args.steps, args.repeats,
                                           args.quick), timeout=3000)  # fmt: skip
    merged = _merge(ranks)
    print(_table(merged), flush=True)
    doc = {
        "benchmark": "recipes",
        "world": 2,
        "backend": "gloo",
        "precision": "32",
        "optimizer": "AdamW, one group",
        "quick": args.quick,
        "steps": args.steps,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "seconds": round(time.perf_counter() - t0, 1),
        "note": args.note,
        "results": merged,
    }
    default = Path(__file__).parent / "results" / f"recipes{'-quick' if args.quick else ''}.json"
    emit(doc, args.out or default)


if __name__ == "__main__":
    main()
