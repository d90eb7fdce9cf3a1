"""Memory per rank while a model is built and prepared: zero3 eager vs meta vs FSDP2.

    flock /tmp/bench.lock python benchmarks/bigmodel_build.py --world 2            # 8 x 4096
    python benchmarks/bigmodel_build.py --world 2 --size 1024                      # a smoke run

The model is ``--layers`` x ``nn.Linear(size, size)`` (8 x 4096: 134M parameters, P = 0.50
GiB fp32), AdamW built over ``model.parameters()`` before preparing, as users write. Each
variant runs in a fresh group of ``--world`` spawned ranks (Gloo, CPU):

- ``rankwise-eager``: built on the CPU, then ``rt.prepare`` under ``strategy="zero3"``;
- ``rankwise-meta``: built under ``torch.device("meta")``, ``rt.prepare`` (reset_parameters);
- ``rankwise-meta-exact``: the same with ``exact_init=True``;
- ``fsdp2-eager``: torch's ``fully_shard`` per layer and on the root, on the CPU-built model;
- ``fsdp2-meta``: ``fully_shard`` on the meta model, ``to_empty(device="cpu")``,
  ``reset_parameters()`` per layer (torch's recipe).

Per rank, the resident-set high-water mark above what the process held before the build
(``VmHWM`` reset through ``/proc/self/clear_refs``; allocations over 1 MiB served by mmap so
freed memory leaves the count at once; a tiny model goes through the same path first, so the
one-time set-up of the first collectives is not counted), in MiB and in units of P: **build**
(constructing the model), **prepare** (sharding it), and what stays resident after prepare.
Max over ranks.
Prints one JSON object and writes ``benchmarks/results/bigmodel_build.json`` (or ``--out``).
``benchmarks/bigmodel.py`` takes the same variants on through training steps, save and load
(it imports this module's model, variants and preparation).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.testing import run_distributed

VARIANTS = ("rankwise-eager", "rankwise-eager-prefetch0", "rankwise-meta", "rankwise-meta-exact",
            "fsdp2-eager", "fsdp2-meta")  # fmt: skip
"""``-prefetch0``: stage 3 gathers no unit ahead (``model.prefetch = 0`` on what ``rt.prepare``
returned, docs/zero.md): one unit whole at a time in backward, beside the one reduction in
flight."""


def _model(size: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(size, size) for _ in range(layers)))


def _tiny(variant: str) -> nn.Sequential:
    with torch.device("meta") if "meta" in variant else contextlib.nullcontext():
        return _model(64, 2)


def _exact_rss() -> None:
    """Allocations over 1 MiB served by mmap: freed tensors leave the resident set at once."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _fsdp2(model: nn.Sequential, meta: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
        for layer in model:
            layer.reset_parameters()


def _prepare(variant: str, rt, model: nn.Sequential) -> object:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant.startswith("fsdp2"):
        _fsdp2(model, meta=variant.endswith("meta"))
        return torch.optim.AdamW(model.parameters(), lr=1e-4)  # FSDP2: built after sharding
    prepared = rt.prepare(model, opt, exact_init=variant.endswith("exact"))
    if variant.endswith("prefetch0"):
        prepared[0].prefetch = 0
    return prepared


def _phase(start_kb: int) -> tuple[float, float]:
    """(peak, now) in MiB above ``start_kb`` since the last reset."""
    return (_status_kb("VmHWM") - start_kb) / 1024, (_status_kb("VmRSS") - start_kb) / 1024


def _one(variant: str, size: int, layers: int) -> dict:
    rt = rw.init(strategy="zero3")
    torch.set_num_threads(1)
    _exact_rss()
    # A tiny model through the same path first: what the first collectives set up once (Gloo's
    # buffers, new groups, ~80 MiB here) is not the model's cost.
    torch.manual_seed(0)
    _prepare(variant, rt, _tiny(variant))
    torch.manual_seed(0)
    _trim_heap()
    base = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := now
    if "meta" in variant:
        with torch.device("meta"):
            model = _model(size, layers)
    else:
        model = _model(size, layers)
    build_peak, build_now = _phase(base)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    kept = _prepare(variant, rt, model)
    prepare_peak, prepare_now = _phase(base)
    del kept
    return {"build_peak_mb": build_peak, "build_mb": build_now,
            "prepare_peak_mb": prepare_peak, "after_prepare_mb": prepare_now}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", type=int, default=4096, help="width of each Linear layer")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bigmodel_build.json"))
    args = ap.parse_args()
    p_mb = args.layers * (args.size * args.size + args.size) * 4 / 2**20
    rows = {}
    for variant in [v for v in args.variants.split(",") if v]:
        ranks = run_distributed(_one, args.world, args=(variant, args.size, args.layers),
                                init=False, timeout=3000)  # fmt: skip
        row = {k: round(max(r[k] for r in ranks), 1) for k in ranks[0]}
        row |= {k.replace("_mb", "_P"): round(v / p_mb, 2) for k, v in row.items()}
        rows[variant] = row
        print(f"{variant:<20} " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    emit({"benchmark": "bigmodel_build", "world": args.world, "layers": args.layers,
          "size": args.size, "P_mb": round(p_mb, 1), "per_rank_max": rows,
          "load_note": "2 shared CPU cores; smoke figures are taken under load"}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
