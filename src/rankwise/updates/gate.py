"""Bounded staleness as pure bookkeeping: which waiting gradients may be applied now.

The staleness of a gradient is the number of server updates applied between the moment its
worker received the parameters (version ``v``) and the moment the gradient itself is applied
(version ``u``): ``u - v``. With a bound ``s`` no gradient may be applied more than ``s`` updates
late, so the server must not move past ``v_oldest + s``, where ``v_oldest`` is the version the
slowest worker is still computing on: nobody runs more than ``s`` updates ahead of the slowest.

A gradient that cannot be applied yet waits in ``pending`` (its worker waits for its reply).
When the gate opens, every pending gradient is applied together as ONE update. With ``s = 0``
this makes a round of all workers' gradients, computed on the same parameters, one update:
exactly synchronous training. With ``s = None`` the gate never closes and each gradient is its
own update (fully asynchronous). No torch.distributed here, so it is tested exhaustively alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError, DistributedError


@dataclass(frozen=True)
class Applied:
    """One gradient in an update: whose, computed on which version, how late it was applied."""

    worker: int
    computed_at: int
    staleness: int


class StalenessGate:
    """Tracks, for each worker, the parameter version it is computing on or has pushed from."""

    def __init__(self, workers: Iterable[int], bound: int | None) -> None:
        if bound is not None and (not isinstance(bound, int) or bound < 0):
            raise ConfigError(
                f"staleness={bound!r} must be None or an integer >= 0",
                fix="use staleness=0 (synchronous), a small bound such as 2, or None (no bound).",
            )
        self.bound = bound
        self.version = 0
        self.workers = frozenset(workers)
        # Every worker counts as computing on version 0 from the start, so that a worker whose
        # first pull is late still holds the server back (else s=0 would not be synchronous).
        self._computing: dict[int, int] = dict.fromkeys(self.workers, 0)
        self._pending: dict[int, int] = {}

    def start(self, worker: int) -> int:
        """``worker`` received the current parameters (its first pull); returns their version."""
        self._known(worker)
        self._computing[worker] = self.version
        return self.version

    def push(self, worker: int) -> list[Applied]:
        """``worker`` pushed a gradient; returns the gradients to apply now as one update."""
        if worker not in self._computing:
            raise DistributedError(
                f"worker rank {worker} pushed a gradient without holding parameters "
                f"(protocol error; pending={sorted(self._pending)})",
                fix="each worker must pull before it pushes; this is a bug in rankwise.",
            )
        self._pending[worker] = self._computing.pop(worker)
        return self._release()

    def leave(self, worker: int) -> list[Applied]:
        """``worker`` stopped training; it no longer holds the server back."""
        self._computing.pop(worker, None)
        return self._release()

    def drop(self, worker: int) -> list[Applied]:
        """``worker`` is gone (it stopped receiving): its held gradient is discarded, and it no
        longer holds the server back."""
        self._pending.pop(worker, None)
        return self.leave(worker)

    @property
    def pending(self) -> list[int]:
        """Workers whose gradient waits for the slowest worker."""
        return sorted(self._pending)

    def _release(self) -> list[Applied]:
        if not self._pending or not self._may_advance():
            return []
        batch = [Applied(w, v, self.version - v) for w, v in sorted(self._pending.items())]
        self._pending.clear()
        self.version += 1
        for a in batch:  # they receive the new parameters and compute on them
            self._computing[a.worker] = self.version
        return batch

    def _may_advance(self) -> bool:
        if self.bound is None:
            return True
        return all(self.version + 1 - v <= self.bound for v in self._computing.values())

    def _known(self, worker: int) -> None:
        if worker not in self.workers:
            raise DistributedError(
                f"rank {worker} is not one of the workers {sorted(self.workers)}",
                fix="every rank must create the update rule with the same arguments.",
            )
