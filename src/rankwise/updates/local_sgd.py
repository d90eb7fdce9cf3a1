"""Local SGD: every rank steps on its own gradients; parameters are averaged every H steps.

Communication drops H-fold and a slow worker only holds the others back at the averaging
points. Between them the replicas drift apart (each follows its own data), which is the price.
Optimizer state (momentum, Adam moments) stays local; only parameters are averaged.
"""

from __future__ import annotations

import torch

from ..comm import collectives as comm
from ..errors import ConfigError
from .base import UpdateRule
from .sync import broadcast_parameters


class LocalSGD(UpdateRule):
    """``step()`` = the user's optimizer step on local gradients; every ``every`` steps, average.

    Sync point: all ranks, at construction, at every ``every``-th ``step()`` and at ``close()``
    (a last average when the step count is not a multiple of ``every``, so replicas end equal).
    """

    name = "local_sgd"
    apart = True  # replicas differ between two averages

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, every: int
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(
                f"local_sgd: every={every!r} must be an integer >= 1",
                fix="average every few steps, e.g. every=4 (every=1 is synchronous averaging).",
            )
        super().__init__(model, optimizer)
        self.every = every
        self.averages = 0
        broadcast_parameters(self)
        self._opened()

    def step(self) -> None:
        self._check_open()
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.every == 0:
            self.average()

    def average(self) -> None:
        """Replace every replica's parameters by their mean. Sync point: all ranks."""
        if self.runtime.distributed:
            flat = self.flat.values()
            comm.all_reduce_(flat, "mean", label=f"local_sgd: parameters, step {self.steps}")
            self.flat.load_values(flat)
        self.averages += 1

    def close(self) -> None:
        """Average once more if steps were taken since the last average. Sync point: all ranks."""
        if self.closed:
            return
        if self.steps % self.every != 0:
            self.average()
        self._closed()


def local_sgd(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, every: int) -> LocalSGD:
    """Wrap ``optimizer``: local steps, parameters averaged over all ranks every ``every`` steps.

    Sync point: all ranks (here, every ``every`` steps, and at ``close()``).
    """
    return LocalSGD(model, optimizer, every=every)
