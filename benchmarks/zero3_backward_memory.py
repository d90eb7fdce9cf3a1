"""Where a ZeRO-3 backward pass peaks, layer by layer: rankwise zero3 (prefetch 1 and 0) beside
torch's FSDP2, the same model and batch, each in fresh spawned ranks (Gloo, CPU).

    flock /tmp/bench.lock python benchmarks/zero3_backward_memory.py --world 2 --size 2048
    python benchmarks/zero3_backward_memory.py --size 256 --layers 4 --out /tmp/z3.json  # smoke

The model is ``--layers`` x ``nn.Linear(size, size)`` with AdamW (``benchmarks/bigmodel.py``'s
model), two steps first, then one measured backward. Each layer gets a backward pre-hook and a
backward hook; at each, the rank records the resident set's high-water mark since the last hook
(``VmHWM``, reset through ``/proc/self/clear_refs``; allocations over 1 MiB served by mmap, so
freed memory leaves the count at once) and the resident set now, both in MiB above the resident
set before the measured forward. A window's ``peak`` is what the rank reached between the
previous hook and this one (``pre3``: the end of layer 4's backward to the start of layer 3's;
``post3``: layer 3's own backward); ``end`` closes the pass (the last reductions). Max over
ranks; ``worst``: the highest window and where it was. Prints JSON and writes
``benchmarks/results/zero3_backward_memory.json`` (or ``--out``).

Why: rankwise's steps peaked above FSDP2's with ``prefetch=1`` and equalled them with
``prefetch=0`` (``bigmodel_round5_prefetch0.json``); this showed the difference inside each
layer's backward, and that it was the reduction left in flight (FSDP2 waits for each at once on
the CPU): ``zero3_backward_memory.json`` before, ``zero3_backward_memory_inflight0.json`` after.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit
from bigmodel_build import _exact_rss, _fsdp2, _model

import rankwise as rw
from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.testing import run_distributed

VARIANTS = ("rankwise-prefetch1", "rankwise-prefetch0", "fsdp2")
BATCH = 8


class _Windows:
    """Per-hook (name, peak MiB since the previous hook, resident MiB now) above ``base``."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float]] = []
        self.base_kb = 0

    def start(self) -> None:
        _trim_heap()
        self.rows.clear()
        self.base_kb = _status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")

    def mark(self, name: str) -> None:
        peak = (_status_kb("VmHWM") - self.base_kb) / 1024
        now = (_status_kb("VmRSS") - self.base_kb) / 1024
        self.rows.append((name, peak, now))
        Path("/proc/self/clear_refs").write_text("5")


def _rank(variant: str, size: int, layers: int) -> list[tuple[str, float, float]]:
    rw.init()
    torch.set_num_threads(1)
    _exact_rss()
    torch.manual_seed(0)
    model = _model(size, layers)
    if variant == "fsdp2":
        _fsdp2(model, meta=False)
        net, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        prefetch = int(variant[-1])
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)
        net = rw.ShardedDataParallel(model, adamw, stage=3, prefetch=prefetch)
        opt = net.optimizer
    win = _Windows()
    for i, layer in enumerate(model):
        layer.register_full_backward_pre_hook(lambda m, g, i=i: win.mark(f"pre{i}"))
        layer.register_full_backward_hook(lambda m, gi, go, i=i: win.mark(f"post{i}"))
    x = torch.randn(BATCH, size, generator=torch.Generator().manual_seed(1))
    x.requires_grad_(True)  # the first layer's backward hook then fires after its own pass
    for _ in range(2):
        F.mse_loss(net(x), x.detach()).backward()
        opt.step()
        opt.zero_grad()
    win.start()
    F.mse_loss(net(x), x.detach()).backward()
    win.mark("end")
    return list(win.rows)


def _merge(ranks: list[list[tuple[str, float, float]]]) -> dict:
    names = [name for name, _, _ in ranks[0]]
    peak = {n: round(max(r[i][1] for r in ranks), 1) for i, n in enumerate(names)}
    now = {n: round(max(r[i][2] for r in ranks), 1) for i, n in enumerate(names)}
    worst = max(peak, key=peak.get)
    return {"peak_mib": peak, "resident_mib": now, "worst": {"window": worst, "mib": peak[worst]}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "zero3_backward_memory.json")
    )
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or args.world < 2 or min(args.size, args.layers) < 1:
        ap.error(f"--variants from {','.join(VARIANTS)} (got {unknown}); --world >= 2 (got "
                 f"{args.world}); --size, --layers >= 1")  # fmt: skip
    unit_mib = (args.size * args.size + args.size) * 4 / 2**20
    result = {"benchmark": "zero3_backward_memory", "world": args.world, "size": args.size,
              "layers": args.layers, "batch": BATCH, "unit_mib": round(unit_mib, 2),
              "shard_mib": round(unit_mib / args.world, 2), "variants": {}}  # fmt: skip
    for variant in variants:
        ranks = run_distributed(_rank, args.world, args=(variant, args.size, args.layers),
                                init=False, timeout=1800, start_method="spawn")  # fmt: skip
        result["variants"][variant] = _merge(ranks)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
