"""The strategies ``rankwise bench`` compares, each a recipe for one training step.

Every strategy trains the same model on the same global batch per step (``nproc * batch``
samples), so step times compare directly and ``single`` is the one-process reference:

==============  ===========  =============================================================
name            who works    what one step is
==============  ===========  =============================================================
single          rank 0       the bare model, 1 intra-op thread, the whole global batch
threads         rank 0       the same with ``nproc`` intra-op threads (torch.set_num_threads)
dp              rank 0       ``rw.DataParallel``: ``nproc`` replicas (CPU threads or GPUs)
ddp             every rank   ``rw.DistributedDataParallel``, each rank its share of the batch
torch-ddp       every rank   torch's own ``DistributedDataParallel``, the reference
zero1/2/3       every rank   ``rw.ShardedDataParallel`` at ZeRO stage 1, 2 or 3 (docs/zero.md)
async           every rank   ``rw.updates.asynchronous``: a parameter server on rank 0
local_sgd       every rank   ``rw.updates.local_sgd``: parameters averaged every H steps
independent     every rank   the bare model on each rank's share, no communication at all:
                             the bound for any multi-process strategy on this machine
==============  ===========  =============================================================

Ranks that do not work in a strategy wait in the collective that ends its timed block (a blocking
wait, measured: they leave the CPU to the working rank).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from . import rows
from .workload import Batch, Workload, evaluate, loss_fn, shard

ALL, EXACT, ON_RANK0 = rows.ALL, rows.EXACT, rows.ON_RANK0
"""Every row ``--strategies`` accepts, the exact ones, the one-process ones (``bench.rows``)."""

ALIASES = {"local-sgd": "local_sgd"}
"""Older spellings ``--strategies`` still accepts, and the name each stands for."""

REFERENCE = "independent"
"""The no-communication baseline, run whenever a multi-process strategy is."""

GLOO_DDP = "ddp-gloo"
"""``ddp`` with ``shared_memory_reduce=False``: every bucket through the backend's all-reduce,
what the network model describes. Only the projection's validation runs it."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What every builder needs, identical on every rank except ``rank``."""

    workload: Workload
    device: torch.device
    rank: int
    world: int
    lr: float
    pool: list[Batch]
    """The global batches (``world * batch`` samples each)."""
    local_sgd_every: int
    async_staleness: int | None


@dataclass
class Trainer:
    """One strategy, built on this rank: ``step()`` runs one training step on the next batch."""

    name: str
    works: bool
    """False on ranks that only wait while rank 0 runs a one-process strategy."""
    model: nn.Module
    """The bare model (for evaluation): the one the optimizer updates."""
    forward: Callable[[torch.Tensor], torch.Tensor]
    optimizer: object
    batches: list[Batch]
    """This rank's share of each global batch, in order."""
    pool: list[Batch]
    """The global batches, for the loss after training."""
    threads: int = 1
    close: Callable[[], None] = field(default=lambda: None)
    steps: int = 0

    def step(self) -> torch.Tensor:
        x, y = self.batches[self.steps % len(self.batches)]
        loss = loss_fn(self.forward(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return loss

    def loss(self) -> float:
        """Mean loss of the current model over the global batches."""
        return evaluate(self.model, self.pool)


def unavailable(name: str, device: torch.device, world: int) -> str | None:
    """Why ``name`` cannot run here (a short reason for the table), or None when it can."""
    if name in rows.UPDATE_RULES and importlib.util.find_spec("rankwise.updates") is None:
        return "not available in this build (rankwise.updates is missing)"
    if name == rows.THREADS and device.type != "cpu":
        return "CPU only (intra-op threads do not speed up a GPU)"
    spec = rows.strategy(name)
    threads = spec is not None and spec.splits_batch_in_process
    if threads and device.type == "cuda" and torch.cuda.device_count() < world:
        return f"needs {world} GPUs in one process, {torch.cuda.device_count()} visible"
    return None


def build(name: str, s: Setup) -> Trainer:
    """Build strategy ``name`` on this rank. Sync point: all ranks for multi-process strategies."""
    if name in ON_RANK0:
        return _one_process(name, s)
    model = s.workload.build(s.device)
    opt = torch.optim.SGD(model.parameters(), lr=s.lr)
    forward: Callable = model
    close: Callable[[], None] = lambda: None  # noqa: E731
    parts, index = s.world, s.rank
    spec = rows.strategy(name)
    if spec is not None and spec.zero_stage:
        from ..parallel import ShardedDataParallel

        sgd = lambda ps: torch.optim.SGD(ps, lr=s.lr)  # noqa: E731
        forward = ShardedDataParallel(model, sgd, spec.zero_stage)
        opt = forward.optimizer
    elif (spec is not None and spec.multi_process) or name == GLOO_DDP:
        from ..parallel import DistributedDataParallel

        shared = False if name == GLOO_DDP else None
        forward = DistributedDataParallel(
            model, device_ids=_ids(s.device), shared_memory_reduce=shared
        )
    elif name == rows.TORCH_DDP:
        forward = torch.nn.parallel.DistributedDataParallel(model, device_ids=_ids(s.device))
    elif name in rows.UPDATE_RULES:
        from .. import updates  # type: ignore[attr-defined]

        if name == "async":
            opt = updates.asynchronous(model, opt, staleness=s.async_staleness)
        else:
            opt = updates.local_sgd(model, opt, every=s.local_sgd_every)
        close = opt.close
        parts, index = opt.num_workers, opt.worker_index
    elif name != REFERENCE:
        raise ValueError(f"unknown strategy {name!r}")
    batches = [shard(b, index, parts) for b in s.pool]
    trainer = Trainer(
        name=name,
        works=True,
        model=model,
        forward=forward,
        optimizer=opt,
        batches=batches,
        pool=s.pool,
        close=close,
    )
    if spec is not None and "parameters" in spec.shards:
        trainer.close = lambda: _consolidate(trainer, s)
    return trainer


def _consolidate(trainer: Trainer, s: Setup) -> None:
    """Stage 3 holds 1/N of the parameters: gather a full model for the loss (every rank)."""
    state = trainer.forward.state_dict()
    trainer.model = s.workload.build(s.device)
    trainer.model.load_state_dict(state)


def _one_process(name: str, s: Setup) -> Trainer:
    works = s.rank == 0
    model = s.workload.build(s.device) if works else nn.Linear(1, 1)
    forward: Callable = model
    spec = rows.strategy(name)
    if works and spec is not None and spec.splits_batch_in_process:
        from ..parallel import DataParallel

        ids = ["cpu"] * s.world if s.device.type == "cpu" else list(range(s.world))
        forward = DataParallel(model, device_ids=ids)
    return Trainer(
        name=name,
        works=works,
        model=model,
        forward=forward,
        optimizer=torch.optim.SGD(model.parameters(), lr=s.lr),
        batches=s.pool if works else [],
        pool=s.pool,
        threads=s.world if name == rows.THREADS else 1,
    )


def _ids(device: torch.device) -> list[torch.device] | None:
    return [device] if device.type == "cuda" else None


def workers(name: str, world: int) -> int:
    """How many workers (threads, replicas or processes) the strategy spreads the batch over."""
    return 1 if name == rows.BASELINE else world
