"""What in-memory replicas cost and save (docs/elastic.md), as JSON:

- ``overhead``: a 2-rank DDP job (Gloo, CPU; an MLP of ``--width`` with AdamW) timed in blocks
  of ``--steps`` steps, replication off and every K steps interleaved block by block
  (``--repeats`` rounds, so the machine's load drifts over all modes alike); the median step
  time of each mode and ``replication_overhead_pct`` against off. ``capture_ms``: the part on
  the training thread (one copy of the state into a buffer); the rest runs in a thread.
- ``cluster`` (root, network namespaces; ``--cluster``): tests/cluster/replicas.py's trial, 3
  hosts x 1 process under ``--nnodes 1:3``, a host killed, then a replacement:
  ``kill_to_training_s``, ``steps_lost``, ``grow_back_s``.

    flock /tmp/rw-bench.lock python benchmarks/recovery.py --cluster --out benchmarks/results/recovery.json

The machine's load average is recorded before and after: on a shared, loaded machine every
time here is longer than on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise.testing import run_distributed


def _block(rt, model, opt, steps: int, reps, start: int) -> float:
    """Seconds per step over ``steps`` steps (replicating through ``reps`` when given)."""
    torch.manual_seed(start + 7919 * rt.rank)  # each rank its own batch, as a split loader's
    x, y = torch.randn(32, rw.unwrap_model(model)[0].in_features), torch.randint(0, 10, (32,))
    begin = time.perf_counter()
    for i in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if reps is not None:
            reps.step(start + i + 1)
    if reps is not None:
        reps.wait()
    rw.barrier()
    return (time.perf_counter() - begin) / steps


def _rank(folder: str, width: int, steps: int, repeats: int, everys: list[int]) -> dict:
    rt = rw.init(strategy="ddp")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = rt.prepare(model, opt)
    reps = {k: rt.replicas(model, opt, every=k, folder=Path(folder) / f"k{k}-r{rt.rank}")
            for k in everys}  # fmt: skip
    times: dict[str, list[float]] = {"off": [], **{str(k): [] for k in everys}}
    captures: list[float] = []
    step = 0
    _block(rt, model, opt, 3, None, 0)  # warm-up: the optimizer's state exists
    for _ in range(repeats):
        for mode in times:
            r = None if mode == "off" else reps[int(mode)]
            times[mode].append(_block(rt, model, opt, steps, r, step))
            step += steps
    for _ in range(5):
        t = time.perf_counter()
        reps[everys[0]].capture(step, None)
        captures.append(time.perf_counter() - t)
    size = reps[everys[0]].state_bytes
    for r in reps.values():
        r.close(remove=True)
    return {"times": times, "capture_s": statistics.median(captures), "state_bytes": size}


def overhead(width: int, steps: int, repeats: int, everys: list[int]) -> dict:
    with tempfile.TemporaryDirectory(prefix="rw-recovery-") as folder:
        ranks = run_distributed(_rank, 2, args=(folder, width, steps, repeats, everys),
                                timeout=1800)  # fmt: skip
    times = ranks[0]["times"]
    step_s = {mode: statistics.median(v) for mode, v in times.items()}
    off = step_s["off"]
    return {
        "world": 2,
        "model": f"MLP {width}x{width}x2 + head, AdamW",
        "state_bytes_per_rank": ranks[0]["state_bytes"],
        "capture_ms": round(1000 * ranks[0]["capture_s"], 2),
        "step_ms": {mode: round(1000 * s, 2) for mode, s in step_s.items()},
        "replication_overhead_pct": {
            k: round(100 * (s - off) / off, 2) for k, s in step_s.items() if k != "off"
        },
        "cost_per_replication_ms": {  # the extra time of a block over off, per copy made
            k: round(1000 * (s - off) * int(k), 2) for k, s in step_s.items() if k != "off"
        },
        "blocks": {mode: [round(1000 * t, 2) for t in v] for mode, v in times.items()},
        "steps_per_block": steps,
        "repeats": repeats,
    }


def cluster() -> dict:
    from cluster import replicas
    from cluster.required import require_cluster  # noqa: F401  (the same requirements)

    with tempfile.TemporaryDirectory(prefix="rw-recovery-cluster-") as folder:
        r = replicas.host_lost(Path(folder), every=1)
    r.pop("text")
    r.pop("worlds")
    r.pop("steps")
    r.pop("cause_lines")
    return {"hosts": 3, "processes_per_host": 1, "every": 1, **r}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--every", default="1,5,20")
    p.add_argument("--cluster", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    everys = [int(k) for k in args.every.split(",")]
    result = {"load_before": os.getloadavg(), "cpus": os.cpu_count(),
              "torch": torch.__version__}  # fmt: skip
    result["overhead"] = overhead(args.width, args.steps, args.repeats, everys)
    if args.cluster:
        result["cluster"] = cluster()
    result["load_after"] = os.getloadavg()
    o, c = result["overhead"], result.get("cluster", {})
    result["summary"] = {  # the keys the goodput model reads
        "kill_to_training_s": c.get("kill_to_training_s"),
        "steps_lost": c.get("steps_lost"),
        "grow_back_s": c.get("grow_back_s"),
        "replication_overhead_pct": o["replication_overhead_pct"],
        "state_bytes_per_rank": o["state_bytes_per_rank"],
        "world": o["world"],
        "hosts": c.get("hosts"),
        "load": [result["load_before"], result["load_after"]],
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
