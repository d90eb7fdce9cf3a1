"""A recipe's proportional memory per rank, each strategy in processes of its own.

    flock /tmp/rw-bench.lock python benchmarks/recipes_memory.py --out benchmarks/results/recipes_memory.json

``benchmarks/recipes.py`` runs every strategy in the same two processes, one after the other:
the first to run pays the process's first-call caches (the allocator's arenas, torch's and
transformers' lazily built tables), so its memory above the start depends on the order.
Here every (strategy, repeat) is a fresh group of ``--world`` Gloo processes: each rank
builds the recipe's model (``recipes._build``, the same weights), wraps it
(``recipes._wrap``), takes ``--steps`` steps and reports its proportional set size
(``Pss`` of ``/proc/self/smaps_rollup``: a shared page counts once over the ranks that map
it, so ddp's shared-memory buckets count half in each of two ranks) above what it held before
the model was built, and its resident high-water mark above the same start. The proportional
set splits every shared page among the processes mapping it, the libraries' pages too, so it
moves with whatever else runs on the machine: compare it only within one quiet run. Strategies
alternate, the order reversed every other repeat; per strategy the median over repeats of the
worse rank. ``independent`` (no communication) is the floor; the JSON gives ddp / torch-ddp
and each one's excess over the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import recipes
from _report import emit

from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.testing import run_distributed


def _rank(recipe: str, name: str, batch: int, steps: int, quick: bool) -> dict:
    torch.set_num_threads(1)
    recipes._exact_rss()
    _trim_heap()
    base_kb, base_pss = _status_kb("VmRSS"), recipes._pss_mb()
    model, opt = recipes._wrap(name, *recipes._build(recipe, quick))
    x, y = recipes._batch(recipe, batch, quick)
    for _ in range(steps):
        recipes._step(recipe, model, opt, x, y)
    return {"pss_mb": recipes._pss_mb() - base_pss,
            "peak_mb": (_status_kb("VmHWM") - base_kb) / 1024}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="gpt2", choices=["gpt2", "nanogpt", "resnet18"])
    ap.add_argument("--strategies", default="ddp,torch-ddp,independent")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the recipe's small model (a smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = [n for n in args.strategies.split(",") if n]
    before = list(os.getloadavg())
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            ranks = run_distributed(_rank, args.world, args=(args.recipe, name, args.batch,
                                                             args.steps, args.quick),
                                     timeout=900)  # fmt: skip
            runs[name].append({k: max(x[k] for x in ranks) for k in ranks[0]})
    rows = {n: {k: round(statistics.median(r[k] for r in rs), 1) for k in rs[0]}
            for n, rs in runs.items()}  # fmt: skip
    result: dict = {"benchmark": "recipes_memory", "recipe": args.recipe, "quick": args.quick,
                    "world": args.world,
                    "batch_per_rank": args.batch, "steps": args.steps, "repeats": args.repeats,
                    "torch": torch.__version__, "rows": rows,
                    "runs": {n: [{k: round(v, 1) for k, v in r.items()} for r in rs]
                             for n, rs in runs.items()}}  # fmt: skip
    if {"ddp", "torch-ddp"} <= set(rows):
        result["ddp_over_torch_ddp"] = {
            k: round(rows["ddp"][k] / rows["torch-ddp"][k], 3) for k in ("pss_mb", "peak_mb")
        }
        if recipes.CEILING in rows:
            floor = rows[recipes.CEILING]["pss_mb"]
            result["pss_above_independent_mb"] = {
                n: round(rows[n]["pss_mb"] - floor, 1) for n in ("ddp", "torch-ddp")
            }
    result["conditions"] = {"fresh_processes_per_run": True, "load_before": before,
                            "load_after": list(os.getloadavg()), "cpus": os.cpu_count()}  # fmt: skip
    return emit(result, args.out)


if __name__ == "__main__":
    main()
