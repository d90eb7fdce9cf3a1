"""What every update rule shares: the user's optimizer inside, the loop unchanged, a clean stop.

An update rule wraps the optimizer the user already built, because ``optimizer.step()`` is exactly
the point where replicas must agree: averaged gradients (synchronous), a round trip to a
parameter server (asynchronous), or a periodic average of parameters (local SGD). The model is
left untouched: no hooks, no wrapper module, so the same model works with every rule and
``state_dict()`` keys stay the user's own.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

import torch

from .. import runtime
from ..comm.flat import FlatParams
from ..errors import ConfigError, RuntimeStateError


def _joined_runtime(name: str) -> runtime.Runtime:
    """The runtime ``rw.init()`` made; alone (world size 1) one is made here, which joins
    nothing. A launched process must call ``rw.init()`` itself: joining the job is a sync
    point, and hiding it inside an optimizer wrapper would hide where ranks meet."""
    if runtime.is_initialized():
        return runtime.get_runtime()
    where = runtime.coords()
    if where.world_size > 1:
        raise RuntimeStateError(
            f"rw.updates ({name}) needs the process group, but this process is rank "
            f"{where.rank} of {where.world_size} ({where.source}) and rankwise is not initialised",
            fix="call `rt = rw.init()` at the start of the program, on every rank, before "
            "wrapping the optimizer.",
            rank=where.rank,
        )
    return runtime.init()


_APART: weakref.WeakSet = weakref.WeakSet()
"""Models whose replicas a rule lets differ between its sync points (``replicas_apart``)."""


def replicas_apart(model: torch.nn.Module) -> bool:
    """Does an update rule let ``model``'s replicas differ between sync points (asynchronous,
    local SGD)? ``rt.save`` then does not compare them (session/saving.py)."""
    return model in _APART


class UpdateRule:
    """Base of the update rules: ``step()``, ``zero_grad()``, ``close()``, a context manager."""

    name = "base"
    apart = False
    """True when replicas may differ between this rule's sync points."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.runtime = _joined_runtime(self.name)
        if self.apart:
            _APART.add(model)
        self.model = model
        self.optimizer = optimizer
        self.flat = FlatParams(model.parameters())
        _check_optimizer_params(self.flat, optimizer, self.name)
        self.steps = 0
        self.closed = True  # until the subclass is fully built and calls _opened()

    # ---- the optimizer interface the training loop uses --------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        raise NotImplementedError

    # ---- who trains on what -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def is_worker(self) -> bool:
        """True when this rank trains (False only on a dedicated parameter server)."""
        return True

    @property
    def num_workers(self) -> int:
        """How many ranks train: shard the data over this many."""
        return self.runtime.world_size

    @property
    def worker_index(self) -> int:
        """This rank's index among the training ranks (0 .. num_workers-1), for data sharding."""
        return self.runtime.rank

    # ---- stopping ----------------------------------------------------------------------------
    def close(self) -> None:
        """End of training. Sync point: all ranks (for rules that communicate)."""
        self._closed()

    def abort(self, exc: BaseException) -> None:
        """This rank failed with ``exc``: stop without waiting for the others."""
        self._closed()

    def _opened(self) -> None:
        """Construction succeeded: from now on, the end of the program must stop us cleanly."""
        self.closed = False
        atexit.register(self._at_exit)

    def _closed(self) -> None:
        self.closed = True
        atexit.unregister(self._at_exit)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeStateError(
                f"step() after close() of the {self.name} update rule",
                fix="create a new update rule for a new training run, or move close() after the loop.",
                rank=self.rank,
            )

    def __enter__(self) -> UpdateRule:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.close()
        elif not self.closed:
            self.abort(exc)
        return False

    def _at_exit(self) -> None:
        # The program ends without close(): by an uncaught exception (Python has set
        # sys.last_value by now) or by forgetting close(); either way, do not leave others hanging.
        if self.closed:
            return
        failure = getattr(sys, "last_value", None)
        try:
            if failure is not None:
                self.abort(failure)
            else:
                self.close()
        except Exception as exc:  # never raise from atexit: just say why the stop was unclean
            print(f"[rank {self.rank}] rankwise {self.name}: {exc}", file=sys.stderr, flush=True)


def _check_optimizer_params(flat: FlatParams, optimizer: torch.optim.Optimizer, name: str) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{name}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}",
            fix="build the optimizer first, e.g. torch.optim.SGD(model.parameters(), lr=0.1), "
            "and pass it with the model.",
        )
    known = {id(p) for p in flat.params}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise ConfigError(
                    f"{name}: parameter group {i} of {type(optimizer).__name__} holds a tensor "
                    f"of shape {tuple(p.shape)} that is not a trainable parameter of the model",
                    fix="build the optimizer over model.parameters() of the model you pass, "
                    "after moving the model to its device.",
                )
