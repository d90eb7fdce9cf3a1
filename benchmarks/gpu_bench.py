"""rankwise's engines vs torch's on ONE GPU: DDP at world 1 (NCCL) and 2 (Gloo), DataParallel.

    python benchmarks/gpu_bench.py --out benchmarks/results/gpu.json   # on a CUDA machine
    python benchmarks/gpu_bench.py --dry-run --out /tmp/gpu.json       # CPU: checks the script

Called by ``benchmarks/gpu_check.sh`` after the ``gpu`` tests. Step = forward, loss, backward,
SGD step, zero_grad, timed between two ``torch.cuda.synchronize()``. Every configuration has
its own model copy (same initial weights); repeats are interleaved with the order alternating,
and each figure is the median over repeats, in ms per step.

- ``ddp_world1_nccl``: one rank in an NCCL group. ``rankwise`` sends nothing at world 1 (there
  is nobody to talk to); ``rankwise_allreduce`` forces its reducer to all-reduce anyway (the
  same work as ``torch``'s DDP, which all-reduces at world 1 too); ``bare`` is the model alone.
- ``ddp_world2_gloo_one_gpu``: two ranks sharing the GPU over Gloo with CUDA tensors (NCCL
  refuses two ranks on one GPU); the slowest rank's time.
- ``dp_one_device``: ``rw.DataParallel(device_ids=[0])`` vs ``torch.nn.DataParallel([0])``, and
  ours on ``[0, 0]`` (two replica threads on one GPU) for information.

``--dry-run`` runs every part on the CPU with a tiny model and Gloo instead of NCCL, so the
script is exercised where there is no GPU (tests/unit/test_gpu_bench.py); its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rankwise as rw
from rankwise.bench import models
from rankwise.parallel.ddp import distributed as ddp_module
from rankwise.parallel.ddp.reduction.reducer import Reducer
from rankwise.testing import run_distributed

TARGETS = {"ddp_world1_nccl": 1.05, "ddp_world1_nccl_same_work": 1.05, "dp_one_device": 1.10}
"""The bars (ours / torch step time at most this): DDP at world 1 as users get it (no
all-reduce) and doing torch's work (all-reduce anyway), DataParallel on one device."""


class TalkingReducer(Reducer):
    """A reducer that all-reduces at world size 1 too (the same work as torch's DDP there)."""

    def _allocate(self, wire: torch.dtype | None) -> None:
        self.communicates = True
        super()._allocate(wire)


@contextlib.contextmanager
def _talking():
    ddp_module.Reducer = TalkingReducer
    try:
        yield
    finally:
        ddp_module.Reducer = Reducer


def _model(cfg: dict, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    if cfg["dry_run"]:
        return models.mlp(in_features=1024, hidden=64, depth=2).to(device)
    return models.mlp().to(device)  # 10.5M parameters


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stepper(model: torch.nn.Module, device: torch.device, cfg: dict) -> Callable[[], None]:
    x, y = models.batch("mlp", cfg["batch"])
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _measure(steppers: dict[str, Callable[[], None]], device: torch.device, cfg: dict) -> dict:
    """Median ms/step per configuration; repeats interleaved, order alternating.

    Sync point: all ranks (when a process group exists: the slowest rank's time counts).
    """
    grouped = dist.is_initialized() and dist.get_world_size() > 1
    for step in steppers.values():  # warm-up: kernels, allocator, NCCL/Gloo connections
        for _ in range(cfg["warmup"]):
            step()
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for r in range(cfg["repeats"]):
        order = list(steppers) if r % 2 == 0 else list(reversed(steppers))
        for name in order:
            if grouped:
                dist.barrier()
            _sync(device)
            start = time.perf_counter()
            for _ in range(cfg["steps"]):
                steppers[name]()
            _sync(device)
            elapsed = torch.tensor([(time.perf_counter() - start) * 1000 / cfg["steps"]])
            if grouped:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def ddp_world1(cfg: dict) -> dict:
    """One rank; NCCL on a GPU (Gloo in a dry run). Runs in a spawned process."""
    device = torch.device("cpu" if cfg["dry_run"] else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cfg["dry_run"] else "nccl", rank=0, world_size=1)
    rw.init()  # adopts the group
    ids = [device] if device.type == "cuda" else None
    ours = rw.DistributedDataParallel(_model(cfg, device), device_ids=ids)
    with _talking():
        talking = rw.DistributedDataParallel(_model(cfg, device), device_ids=ids)
    theirs = torch.nn.parallel.DistributedDataParallel(_model(cfg, device), device_ids=ids)
    steppers = {
        "rankwise": _stepper(ours, device, cfg),
        "rankwise_allreduce": _stepper(talking, device, cfg),
        "torch": _stepper(theirs, device, cfg),
        "bare": _stepper(_model(cfg, device), device, cfg),
    }
    return {"backend": str(dist.get_backend()), "step_ms": _measure(steppers, device, cfg)}


def ddp_world2(cfg: dict) -> dict:
    """Two ranks on one GPU over Gloo (CUDA tensors). Runs in spawned processes."""
    device = torch.device("cpu" if cfg["dry_run"] else "cuda:0")
    rw.init("gloo", device=device)
    ids = [device] if device.type == "cuda" else None
    ours = rw.DistributedDataParallel(_model(cfg, device), device_ids=ids)
    theirs = torch.nn.parallel.DistributedDataParallel(_model(cfg, device), device_ids=ids)
    steppers = {"rankwise": _stepper(ours, device, cfg), "torch": _stepper(theirs, device, cfg)}
    return {"backend": "gloo", "step_ms": _measure(steppers, device, cfg)}


def dp_one_device(cfg: dict) -> dict:
    """In this process: DataParallel on one device, ours and torch's."""
    device = torch.device("cpu" if cfg["dry_run"] else "cuda:0")
    ids: list = ["cpu"] if cfg["dry_run"] else [0]
    twice: list = ["cpu", "cpu"] if cfg["dry_run"] else [0, 0]
    theirs = torch.nn.DataParallel(_model(cfg, device), device_ids=None if cfg["dry_run"] else ids)
    steppers = {
        "rankwise": _stepper(rw.DataParallel(_model(cfg, device), device_ids=ids), device, cfg),
        "torch": _stepper(theirs, device, cfg),
        "bare": _stepper(_model(cfg, device), device, cfg),
        "rankwise_two_replicas": _stepper(
            rw.DataParallel(_model(cfg, device), device_ids=twice), device, cfg
        ),
    }
    return {"device_ids": [str(i) for i in ids], "step_ms": _measure(steppers, device, cfg)}


def _ratios(part: dict, pairs: dict[str, tuple[str, str]]) -> None:
    ms = part["step_ms"]
    part["ratios"] = {name: round(ms[a] / ms[b], 3) for name, (a, b) in pairs.items()}


def run(cfg: dict) -> dict:
    if not cfg["dry_run"] and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device here; use --dry-run to check the script")
    timeout = cfg["timeout"]
    (w1,) = run_distributed(ddp_world1, 1, args=(cfg,), init=False, timeout=timeout)
    _ratios(w1, {"rankwise_over_torch": ("rankwise", "torch"),
                 "rankwise_allreduce_over_torch": ("rankwise_allreduce", "torch")})  # fmt: skip
    w2 = run_distributed(ddp_world2, 2, args=(cfg,), init=False, timeout=timeout)[0]
    _ratios(w2, {"rankwise_over_torch": ("rankwise", "torch")})
    dp = dp_one_device(cfg)
    _ratios(dp, {"rankwise_over_torch": ("rankwise", "torch")})
    ratio = {
        "ddp_world1_nccl": w1["ratios"]["rankwise_over_torch"],
        "ddp_world1_nccl_same_work": w1["ratios"]["rankwise_allreduce_over_torch"],
        "dp_one_device": dp["ratios"]["rankwise_over_torch"],
    }
    return {
        "benchmark": "gpu",
        "dry_run": cfg["dry_run"],
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": "mlp",
        "parameters": models.num_parameters(_model(cfg, torch.device("cpu"))),
        "batch": cfg["batch"],
        "steps_per_repeat": cfg["steps"],
        "repeats": cfg["repeats"],
        "gpu_tests_exit_code": cfg["tests_rc"],
        "ddp_world1_nccl": w1,
        "ddp_world2_gloo_one_gpu": w2,
        "dp_one_device": dp,
        "targets": TARGETS,
        "meets_targets": {k: ratio[k] <= TARGETS[k] for k in TARGETS},
    }


def parse(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the script")
    p.add_argument("--batch", type=int, default=None, help="samples per step (default 512)")
    p.add_argument("--steps", type=int, default=None, help="steps per repeat (default 20)")
    p.add_argument("--repeats", type=int, default=None, help="repeats (default 7)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5)")
    p.add_argument("--timeout", type=float, default=300.0, help="per spawned part, seconds")
    p.add_argument("--tests-rc", type=int, default=None, help="exit code of the gpu tests")
    a = p.parse_args(argv)
    defaults = {"batch": (8, 512), "steps": (2, 20), "repeats": (1, 7), "warmup": (1, 5)}
    cfg = {"out": a.out, "dry_run": a.dry_run, "timeout": a.timeout, "tests_rc": a.tests_rc}
    for key, (dry, real) in defaults.items():
        given = getattr(a, key)
        cfg[key] = given if given is not None else (dry if a.dry_run else real)
        if cfg[key] < (0 if key == "warmup" else 1):
            p.error(f"--{key} must be at least {0 if key == 'warmup' else 1}, got {cfg[key]}")
    return cfg


def main(argv: list[str] | None = None) -> dict:
    cfg = parse(argv)
    result = run({k: v for k, v in cfg.items() if k != "out"})
    text = json.dumps(result, indent=2)
    print(text)
    cfg["out"].parent.mkdir(parents=True, exist_ok=True)
    cfg["out"].write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
