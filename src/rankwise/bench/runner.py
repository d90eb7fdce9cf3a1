"""Run the strategies side by side in one set of processes, repeats interleaved.

One job of ``nproc`` ranks runs everything, so every strategy meets the same machine:

1. **Timing.** Every strategy is built once and warmed up; then each repeat runs every
   strategy for ``steps`` steps, in an order rotated by one each repeat, so a noisy neighbour
   or a frequency change slows all strategies alike. A strategy's step time in a repeat is the
   slowest rank's mean (ranks start together after a barrier).
2. **Communication.** The all-reduce sweep of ``rankwise bench comm`` on the same ranks; its
   alpha-beta fit feeds the projection.
3. **Memory and loss.** Each strategy again, alone and fresh from the same initial model:
   ``steps`` steps with the peak memory of every rank recorded, then the loss of the final
   model on the global batches (the model after exactly ``steps`` steps).

Then, for the projection's validation, a small job per extra world size times ``independent``
and ``ddp`` the same way.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..comm import wire
from ..errors import ConfigError
from ..output.log import TaskBar, task_bar
from . import rows
from . import strategies as st
from .memory import PeakMemory
from .network.commbench import SIZES
from .network.projection import parse_network
from .workload import resolve


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything one ``rankwise bench`` run needs (the command line, validated)."""

    model: str = "mlp"
    """Reference model name ('mlp', 'cnn') or ``module:factory``."""
    data: str | None = None
    """``module:function`` making ``(inputs, targets)`` batches; default ``<module>:batch``."""
    strategies: tuple[str, ...] = st.ALL
    """Strategies to compare (``independent`` is added for multi-process ones)."""
    nproc: int = 2
    """Processes (and threads, DP replicas) every parallel strategy uses."""
    steps: int = 5
    """Steps per timed repeat, and the steps after which the loss is reported."""
    batch: int = 32
    """Samples per worker per step: the global batch is ``nproc * batch`` for every strategy."""
    repeats: int = 5
    """Timed repeats per strategy (interleaved)."""
    lr: float = 0.01
    """SGD learning rate (no momentum)."""
    local_sgd_every: int = 4
    """local_sgd averages parameters every this many steps."""
    async_staleness: int | None = None
    """async: staleness bound (None: fully asynchronous)."""
    device: str = "auto"
    """'auto' (CUDA when available), 'cpu' or 'cuda'."""
    validate_worlds: tuple[int, ...] = (2, 3, 4)
    """World sizes whose measured synchronous step validates the projection."""
    network: str | None = None
    """``BANDWIDTH,LATENCY`` for the projection, e.g. '100Gbps,5us'; default: measured here."""
    node_network: str | None = None
    """``BANDWIDTH,LATENCY`` of the link between nodes: the projection adds steps across nodes
    of ``ranks_per_node`` ranks, flat ring and hierarchical (``across_nodes.py``)."""
    ranks_per_node: int | None = None
    """Ranks per node in the projection across nodes; default ``nproc``."""
    comm_sizes: tuple[int, ...] = SIZES
    """All-reduce message sizes (bytes) measured for the alpha-beta fit."""
    timeout: float = 900.0
    """Seconds the whole job (and any one collective) may take."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in st.ALL]
        if unknown or not self.strategies:
            raise ConfigError(
                f"--strategies {','.join(self.strategies)!r}: unknown {unknown}",
                fix=f"choose from {','.join(st.ALL)}.",
            )
        for flag, value, low in (
            ("--nproc-per-node", self.nproc, 2),
            ("--steps", self.steps, 1),
            ("--batch", self.batch, 1),
            ("--repeats", self.repeats, 1),
            ("--local-sgd-every", self.local_sgd_every, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ConfigError(
                    f"{flag} {value!r} must be an integer >= {low}",
                    fix=f"e.g. {flag} {max(low, 2)}",
                )
        if any(w < 2 for w in self.validate_worlds):
            raise ConfigError(
                f"--validate {self.validate_worlds} must list world sizes >= 2",
                fix="e.g. --validate 2,3,4, or --validate none",
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(
                f"--device {self.device!r} is not auto, cpu or cuda", fix="--device cpu"
            )
        for flag, value in (("--network", self.network), ("--node-network", self.node_network)):
            if value is not None:
                parse_network(value, flag)
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ConfigError(
                f"--ranks-per-node {self.ranks_per_node!r} must be an integer >= 1",
                fix="e.g. --ranks-per-node 8 (GPUs per machine)",
            )
        resolve(self.model, self.data)  # a bad --model fails here, not inside the ranks


def device_and_backend(cfg: BenchConfig) -> tuple[str, str]:
    """(device type, backend) for the job; CUDA needs one GPU per process."""
    cuda = torch.cuda.is_available() if cfg.device == "auto" else cfg.device == "cuda"
    if not cuda:
        return "cpu", "gloo"
    count = torch.cuda.device_count()
    if count < cfg.nproc:
        raise ConfigError(
            f"--nproc-per-node {cfg.nproc} needs {cfg.nproc} GPUs (one per process), "
            f"{count} visible",
            fix=f"use --nproc-per-node {count} if that is at least 2, or --device cpu.",
        )
    return "cuda", "nccl"


def _timed(trainer: st.Trainer, steps: int, device: torch.device) -> float:
    """Mean ms per step of the slowest rank. Sync point: all ranks."""
    torch.set_num_threads(trainer.threads)
    dist.barrier()
    start = time.perf_counter()
    if trainer.works:
        for _ in range(steps):
            trainer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = (time.perf_counter() - start) * 1e3 / steps if trainer.works else 0.0
    torch.set_num_threads(1)
    t = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _setup(cfg: BenchConfig, device: torch.device) -> st.Setup:
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = resolve(cfg.model, cfg.data)
    return st.Setup(
        workload=workload,
        device=device,
        rank=rank,
        world=world,
        lr=cfg.lr,
        pool=workload.pool(world * cfg.batch, device),
        local_sgd_every=cfg.local_sgd_every,
        async_staleness=cfg.async_staleness,
    )


def time_strategies(
    cfg: BenchConfig, names: list[str], setup: st.Setup, bar: TaskBar | None = None
) -> dict[str, list[float]]:
    """Step times (ms) of every strategy in every repeat, interleaved. Sync point: all ranks."""
    bar = bar or TaskBar()
    built = {name: st.build(name, setup) for name in names}
    for name, trainer in built.items():
        _timed(trainer, 2, setup.device)  # warm-up: allocator, DDP buckets, server threads
        bar.update(f"warm-up {name}")
    runs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(cfg.repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            runs[name].append(round(_timed(built[name], cfg.steps, setup.device), 3))
            bar.update(f"repeat {r + 1}/{cfg.repeats}: {name}")
    for trainer in built.values():
        trainer.close()
    return runs


def memory_and_loss(
    cfg: BenchConfig, names: list[str], setup: st.Setup, bar: TaskBar | None = None
) -> dict[str, dict]:
    """Per strategy, fresh: peak memory of each rank over ``steps`` steps, then the loss.

    Sync point: all ranks.
    """
    out = {}
    for name in names:
        meter = PeakMemory(setup.device)
        dist.barrier()
        meter.start()
        trainer = st.build(name, setup)
        torch.set_num_threads(trainer.threads)
        if trainer.works:
            for _ in range(cfg.steps):
                trainer.step()
        torch.set_num_threads(1)
        peak = meter.peak_mb() if trainer.works else None  # the steps, not what close() does
        trainer.close()
        loss = trainer.loss() if setup.rank == 0 else None
        peaks = wire.all_gather_json(peak, label="bench peak memory")
        out[name] = {"peak_mb": peaks, "loss": loss, "memory_method": meter.method}
        del trainer
        (bar or TaskBar()).update(f"memory and loss: {name}")
    return out


def _worker(cfg: BenchConfig, names: list[str], extras: bool, desc: str = "bench") -> dict:
    torch.set_num_threads(1)
    from ..runtime import get_runtime

    device = get_runtime().device
    setup = _setup(cfg, device)
    # Units of work: warm-up and each repeat of each strategy, then the sweep and memory runs.
    total = len(names) * (1 + cfg.repeats) + (1 + len(names) if extras else 0)
    bar = task_bar(total, f"rankwise {desc}", unit="run")
    try:
        result: dict = {"times": time_strategies(cfg, names, setup, bar)}
        if extras:
            from .network.commbench import measure

            bar.update("all-reduce sweep", n=0)
            result["comm"] = measure(cfg.comm_sizes, repeats=3)
            bar.update("all-reduce sweep")
            result["memory_loss"] = memory_and_loss(cfg, names, setup, bar)
    finally:
        bar.close()
    return result


def plan(cfg: BenchConfig, device_type: str) -> tuple[list[str], dict[str, str]]:
    """(strategies to run in order, {strategy: why it cannot run})."""
    device = torch.device(device_type)
    skipped = {}
    names = []
    # The one-process reference every speedup is measured against is always run.
    for name in (rows.BASELINE, *[s for s in cfg.strategies if s != rows.BASELINE]):
        reason = st.unavailable(name, device, cfg.nproc)
        if reason:
            skipped[name] = reason
        else:
            names.append(name)
    if any(n not in st.ON_RANK0 for n in names):
        names.append(st.REFERENCE)
    return names, skipped


def run(cfg: BenchConfig, log=print) -> dict:
    """Run the whole benchmark; returns the raw measurements for ``report.build``."""
    from ..testing import run_distributed

    device_type, backend = device_and_backend(cfg)
    names, skipped = plan(cfg, device_type)
    log(
        f"rankwise bench: {cfg.model}, {cfg.nproc} processes ({backend}), "
        f"strategies {', '.join(names)}; {cfg.repeats} repeats of {cfg.steps} steps"
    )
    t0 = time.perf_counter()
    load = _load()
    main = run_distributed(
        _worker, cfg.nproc, args=(cfg, names, True), backend=backend, timeout=cfg.timeout
    )[0]
    validation = _validate(cfg, main["times"], backend, log)
    return {
        "names": names,
        "skipped": skipped,
        "device": device_type,
        "backend": backend,
        "main": main,
        "validation": validation,
        "seconds": round(time.perf_counter() - t0, 1),
        "loadavg_1m": [load, _load()],
    }


def _validate(cfg: BenchConfig, times: dict, backend: str, log) -> dict[int, dict]:
    """Median ``independent`` and ``ddp`` step (ms) at each world size of ``--validate``."""
    from ..testing import run_distributed

    out = {}
    # On one machine over Gloo, ddp averages large buckets through shared memory and beats a
    # network model fitted on Gloo's all-reduce: validate the model with Gloo-only ddp then.
    ddp = st.GLOO_DDP if backend == "gloo" and _ddp_shares_memory(cfg) else rows.REPLICATED
    for world in sorted(set(cfg.validate_worlds)):
        if backend == "nccl" and world > torch.cuda.device_count():
            log(f"rankwise bench: no validation at world size {world}: not enough GPUs")
            continue
        here = times
        if world != cfg.nproc or ddp not in times:
            log(f"rankwise bench: validation run at world size {world}")
            args = (replace(cfg, nproc=world), [ddp, st.REFERENCE], False, f"world {world}")
            job = run_distributed(_worker, world, args=args, backend=backend, timeout=cfg.timeout)
            here = job[0]["times"]
        out[world] = {
            "independent_ms": statistics.median(here[st.REFERENCE]),
            "ddp_ms": statistics.median(here[ddp]),
            "strategy": ddp,
        }
    return out


def _ddp_shares_memory(cfg: BenchConfig) -> bool:
    """Whether ``ddp`` has a bucket large enough for shared memory (on one CPU machine)."""
    from ..parallel import buckets
    from ..parallel.ddp.node import shared_reduce

    model = resolve(cfg.model, cfg.data).build(torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    return shared_reduce.worth_sharing(buckets.assign_buckets(params))


def _load() -> float | None:
    """The machine's 1-minute load average (a shared machine: say how busy it was)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
