"""Peak resident memory per rank: rankwise's DistributedDataParallel vs torch's.

    python benchmarks/ddp_memory.py --out benchmarks/results/ddp_memory.json

Each configuration runs in fresh processes (world size 2, gloo, one thread each; the peak of a
process cannot be reset), on the reference MLP (10.5M parameters: 42 MB of parameters and as
much of gradients): 6 steps of forward, backward and SGD, with ``zero_grad`` first
(``set_to_none=True``) or last (``set_to_none=False``). Reported: each rank's peak resident set
(``ru_maxrss``) and its growth over the process before the model was built, in MiB, the
largest over the ranks, and the growth of its proportional set size after the last step
(``pss_growth_mib``: shared pages split between the processes that map them, so the shared
gradient file is not counted once per rank). torch is run with its default and with ``gradient_as_bucket_view=True``;
rankwise with its default (large buckets in shared memory: their pages count in the resident
set of every rank that touches them) and with ``shared_memory_reduce=False`` (``rankwise_gloo``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _report import emit

import rankwise as rw
from rankwise.bench import models
from rankwise.testing import run_distributed

KINDS = ("rankwise", "rankwise_gloo", "torch", "torch_bucket_view")
ORDERS = ("first/none", "last/zero")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _pss_mib() -> float:
    """Proportional set size now: a page shared by k processes counts 1/k in each (Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return float("nan")
    return kib / 1024


def _one(kind: str, order: str) -> dict:
    torch.set_num_threads(1)
    before, pss_before = _peak_mib(), _pss_mib()
    torch.manual_seed(0)
    net = models.build("mlp")
    if kind.startswith("rankwise"):  # rankwise_gloo: no shared memory, every bucket via Gloo
        model = rw.DistributedDataParallel(net, shared_memory_reduce=kind == "rankwise")
    else:
        view = kind == "torch_bucket_view"
        model = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = models.batch("mlp", 32, seed=rw.get_runtime().rank)
    for _ in range(6):
        if order == "first/none":
            opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if order == "last/zero":
            opt.zero_grad(set_to_none=False)
    return {
        "peak_mib": round(_peak_mib(), 1),
        "growth_mib": round(_peak_mib() - before, 1),
        "pss_growth_mib": round(_pss_mib() - pss_before, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    table: dict = {}
    for kind in KINDS:
        for order in ORDERS:
            ranks = run_distributed(_one, 2, args=(kind, order), timeout=300)
            table[f"{kind}/{order}"] = {
                k: max(r[k] for r in ranks) for k in ("peak_mib", "growth_mib", "pss_growth_mib")
            }
    result = {
        "benchmark": "ddp_memory",
        "model": "mlp",
        "world_size": 2,
        "torch": torch.__version__,
        "per_rank_mib": table,
        "pss_ratio_over_torch": {  # memory, not time: the machine's load does not move it much
            f"{ours}/{order}": round(table[f"{ours}/{order}"]["pss_growth_mib"]
                                     / table[f"torch/{order}"]["pss_growth_mib"], 3)
            for ours in ("rankwise", "rankwise_gloo") for order in ORDERS
        },
        "pss_ratio_over_torch_bucket_view": {
            f"{ours}/{order}": round(table[f"{ours}/{order}"]["pss_growth_mib"]
                                     / table[f"torch_bucket_view/{order}"]["pss_growth_mib"], 3)
            for ours in ("rankwise", "rankwise_gloo") for order in ORDERS
        },
        "conditions": {"steps": 6, "fresh_processes_per_configuration": True,
                       "load_before": load_before, "load_after": os.getloadavg()},
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
