"""Synchronous vs asynchronous vs local SGD with one slow worker, in the same processes.

    flock /tmp/rankwise-bench.lock python benchmarks/updates.py --world 3 --out results/updates

Each rank trains the same linear least-squares model on its shard of synthetic data (minibatch
SGD). A step "computes" for ``--step-ms`` (a sleep, so that the machine's load does not decide
the result) and the last rank is ``--slow-factor`` times slower. Every strategy trains for the
same wall-clock budget; repeats are interleaved, and torch's own DistributedDataParallel runs in
the same processes as the synchronous reference. Measured:

- samples/s: all ranks' samples over the time until the last rank stopped;
- the full-data loss of rank 0's parameters after each of its steps, against time (the curves);
- ``jitter``: the median |log(loss_t / loss_{t-1})| over the second half of a run, step to step,
  and ``loss_up_fraction``: how often one of rank 0's steps made the full-data loss go up;
- for async, the staleness of every applied gradient (the server's histogram).

Prints one JSON object and, with ``--out DIR``, writes DIR/updates.json and DIR/updates.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rankwise as rw
from rankwise.testing import run_distributed

STRATEGIES = {
    "sync": ("sync", {}),
    "torch-ddp": ("torch-ddp", {}),
    "async s=0": ("async", {"staleness": 0}),
    "async s=2": ("async", {"staleness": 2}),
    "async s=None": ("async", {"staleness": None}),
    "local_sgd H=4": ("local_sgd", {"every": 4}),
}


def _data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg["rows"], cfg["dim"], generator=g)
    w = torch.randn(cfg["dim"], 1, generator=g)
    return x, x @ w + cfg["noise"] * torch.randn(cfg["rows"], 1, generator=g)


class _TorchDDP:
    """torch's DDP driven like our strategies: backward already reduced, step = optimizer step."""

    is_worker, closed = True, False

    def __init__(self, model, optimizer):
        self.ddp = torch.nn.parallel.DistributedDataParallel(model)
        self.optimizer, self.steps = optimizer, 0
        self.num_workers, self.worker_index = dist.get_world_size(), dist.get_rank()

    def step(self):
        self.optimizer.step()
        self.steps += 1

    def zero_grad(self):
        self.optimizer.zero_grad()

    def close(self):
        pass


def _agree_to_stop(deadline: float) -> bool:
    """Lockstep strategies must stop at the same step: any rank past the deadline stops all."""
    flag = torch.tensor([time.monotonic() > deadline], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _make(name: str, cfg: dict):
    kind, options = STRATEGIES[name]
    torch.manual_seed(1)
    model = torch.nn.Linear(cfg["dim"], 1)
    base = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    if kind == "torch-ddp":
        opt = _TorchDDP(model, base)
        return model, opt.ddp, opt
    return model, model, rw.updates.wrap(model, base, rule=kind, **options)


def _train_for(name: str, cfg: dict, model, forward, opt) -> tuple[float, list]:
    """Train until the budget is spent; the last rank sleeps longer per step (the slow worker)."""
    kind, options = STRATEGIES[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(cfg)
    shard_x, shard_y = (
        x[opt.worker_index :: opt.num_workers],
        y[opt.worker_index :: opt.num_workers],
    )
    gen = torch.Generator().manual_seed(100 + rank)
    step_s = cfg["step_ms"] / 1000 * (cfg["slow_factor"] if rank == world - 1 else 1.0)
    every = options.get("every", 1)
    curve: list[tuple[float, float]] = []
    dist.barrier()
    start = time.monotonic()
    deadline = start + cfg["seconds"]
    while True:
        if kind == "async":  # no agreement needed: each worker stops on its own
            if time.monotonic() > deadline:
                break
        elif opt.steps % every == 0 and _agree_to_stop(deadline):
            break
        idx = torch.randint(0, shard_x.shape[0], (cfg["batch"],), generator=gen)
        F.mse_loss(forward(shard_x[idx]), shard_y[idx]).backward()
        time.sleep(step_s)  # the simulated compute of this worker
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with torch.no_grad():
                curve.append((time.monotonic() - start, F.mse_loss(model(x), y).item()))
    return time.monotonic() - start, curve


def _run(name: str, cfg: dict) -> dict:
    model, forward, opt = _make(name, cfg)
    elapsed, curve = _train_for(name, cfg, model, forward, opt)
    opt.close()
    stats = opt.server_stats() if STRATEGIES[name][0] == "async" else None
    totals = torch.tensor([opt.steps * cfg["batch"], elapsed], dtype=torch.float64)
    gathered = [torch.zeros_like(totals) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, totals)
    x, y = _data(cfg)
    with torch.no_grad():
        final = F.mse_loss(model(x), y).item()
    return {
        "samples_per_s": sum(float(t[0]) for t in gathered) / max(float(t[1]) for t in gathered),
        "steps_per_rank": [int(t[0]) // cfg["batch"] for t in gathered],
        "wall_s": max(float(t[1]) for t in gathered),
        "final_loss": final,
        "curve": curve,
        "staleness_histogram": None if stats is None else stats.staleness_histogram,
        "server_updates": None if stats is None else stats.updates,
    }


def _bench(cfg: dict) -> dict | None:
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {name: [] for name in cfg["strategies"]}
    for r in range(cfg["repeats"]):
        order = cfg["strategies"] if r % 2 == 0 else list(reversed(cfg["strategies"]))
        for name in order:
            runs[name].append(_run(name, cfg))
    return runs if dist.get_rank() == 0 else None


def _jitter(curve: list[tuple[float, float]]) -> float:
    losses = [loss for _, loss in curve[len(curve) // 2 :]]
    steps = [abs(math.log(b / a)) for a, b in itertools.pairwise(losses) if a > 0 < b]
    return statistics.median(steps) if steps else float("nan")


def _ups(curve: list[tuple[float, float]]) -> float:
    """Fraction of rank 0's steps after which the full-data loss went up (whole run)."""
    losses = [loss for _, loss in curve]
    ups = [b > a for a, b in itertools.pairwise(losses)]
    return sum(ups) / len(ups) if ups else float("nan")


def _summarise(cfg: dict, runs: dict[str, list[dict]]) -> dict:
    out = {"config": cfg, "strategies": {}}
    for name, reps in runs.items():
        out["strategies"][name] = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in reps),
            "samples_per_s_repeats": [round(r["samples_per_s"], 1) for r in reps],
            "steps_per_rank": reps[-1]["steps_per_rank"],
            "final_loss": statistics.median(r["final_loss"] for r in reps),
            "jitter": statistics.median(_jitter(r["curve"]) for r in reps),
            "loss_up_fraction": statistics.median(_ups(r["curve"]) for r in reps),
            "staleness_histogram": reps[-1]["staleness_histogram"],
            "server_updates": reps[-1]["server_updates"],
        }
    s = out["strategies"]
    ratio = {}
    for name in s:
        if name != "sync" and "sync" in s:
            ratio[f"{name} / sync"] = round(
                s[name]["samples_per_s"] / s["sync"]["samples_per_s"], 3
            )
    out["throughput_ratio"] = ratio
    out["noise_floor_loss"] = cfg["noise"] ** 2
    out["curves_rank0"] = {name: reps[-1]["curve"] for name, reps in runs.items()}
    return out


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_zoom, ax_bar) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, curve in result["curves_rank0"].items():
        t, loss = zip(*curve, strict=True) if curve else ((), ())
        ax_loss.plot(t, loss, label=name, lw=1)
        ax_zoom.plot(t, loss, label=name, lw=1)
    floor = result["noise_floor_loss"]
    for ax in (ax_loss, ax_zoom):
        ax.axhline(floor, color="grey", ls=":", lw=1)
        ax.set_xlabel("wall time (s)")
        ax.set_yscale("log")
    ax_loss.set_ylabel("full-data MSE of rank 0's parameters")
    ax_loss.set_title("loss after each of rank 0's steps")
    ax_zoom.set_ylim(floor * 0.9, floor * 3)
    ax_zoom.set_title("zoom near the noise floor (dotted)")
    ax_loss.legend(fontsize=8)
    names = list(result["strategies"])
    ax_bar.bar(names, [result["strategies"][n]["samples_per_s"] for n in names])
    ax_bar.set_ylabel("samples/s (all ranks)")
    ax_bar.tick_params(axis="x", rotation=30, labelsize=8)
    cfg = result["config"]
    ax_bar.set_title(
        f"world {cfg['world']}, step {cfg['step_ms']} ms, last rank {cfg['slow_factor']}x slower"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated compute per step")
    p.add_argument("--slow-factor", type=float, default=2.0, help="the last rank's slowdown")
    p.add_argument("--seconds", type=float, default=4.0, help="training budget per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=None, help="directory for updates.json/.png")
    args = p.parse_args(argv)
    cfg = {
        "world": args.world,
        "step_ms": args.step_ms,
        "slow_factor": args.slow_factor,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "strategies": args.strategies.split(","),
        "lr": args.lr,
        "rows": 4096,
        "dim": 32,
        "batch": 32,
        "noise": 0.5,
    }
    timeout = 120 + 2 * args.repeats * len(cfg["strategies"]) * (args.seconds + 5)
    runs = run_distributed(_bench, args.world, args=(cfg,), timeout=timeout)[0]
    result = _summarise(cfg, runs)
    brief = {k: v for k, v in result.items() if k != "curves_rank0"}
    print(json.dumps(brief, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "updates.json").write_text(json.dumps(result, indent=1))
        _plot(result, args.out / "updates.png")
    return result


if __name__ == "__main__":
    main()
