"""Synchronous updates: every rank's gradients are averaged, then every rank takes the same step.

The baseline the others are measured against: a step costs the slowest worker's time plus one
all-reduce. (rankwise.DistributedDataParallel does the same averaging overlapped with backward;
this update rule is the plain per-step version, with no hooks on the model.)
"""

from __future__ import annotations

import torch

from ..comm import collectives as comm
from .base import UpdateRule


class SyncUpdates(UpdateRule):
    """``step()`` = all-reduce the mean gradient (one flat buffer), then the user's optimizer step.

    Construction broadcasts rank 0's parameters so that every replica starts equal.
    Sync point: all ranks, at construction and at every ``step()``.
    """

    name = "sync"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        broadcast_parameters(self)
        self._opened()

    def step(self) -> None:
        self._check_open()
        if self.runtime.distributed:
            flat = self.flat.grads()
            comm.all_reduce_(flat, "mean", label=f"{self.name}: gradients, step {self.steps}")
            self.flat.load_grads(flat)
        self.optimizer.step()
        self.steps += 1


def synchronous(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> SyncUpdates:
    """Wrap ``optimizer`` so that ``step()`` applies the gradient averaged over all ranks.

    Sync point: all ranks (here and at every ``step()``).
    """
    return SyncUpdates(model, optimizer)


def broadcast_parameters(rule: UpdateRule) -> None:
    """Rank 0's parameter values on every rank. Sync point: all ranks."""
    if rule.runtime.distributed:
        flat = rule.flat.values()
        comm.broadcast_(flat, src=0, label=f"{rule.name}: rank 0's parameters")
        rule.flat.load_values(flat)
