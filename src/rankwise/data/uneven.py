"""``rw.join``: step through uneven iterators on every rank without the short ranks hanging.

When one rank runs out of batches while the others go on, the others block in their next
gradient all-reduce for a partner that never comes. The loaders of ``rw.loader`` cannot get
there (the sampler gives every rank the same number of batches), but a user's own iterator can
(a stream, a filtered dataset, a bucketing sampler). ``join`` makes the ranks agree, before each
step, whether everyone still has a batch:

    with rw.join(my_uneven_batches) as batches:
        for x, y in batches:
            ...  # forward, backward (DDP all-reduce), step

Semantics: **all ranks stop together at the first step where any rank has no batch** (the
shortest rank decides). Batches the other ranks still had are skipped; ``ranks_out_of_data``
says how many ranks had run out. A ``break`` on some ranks only also stops the others at the
same step (the rank that leaves tells them on its way out of the ``with`` block), which is why
``join`` must be used as a context manager. Cost: one all-reduce of one number per step.
If the loop body raises on one rank, the others are not told; they fail when the runtime's
collective timeout expires, as with any collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from .. import validate
from ..comm import collectives as comm
from ..errors import RuntimeStateError
from . import _coords

T = TypeVar("T")
_END = object()


class Join(Generic[T]):
    """Context manager that yields the batches of ``iterable`` while every rank still has one."""

    def __init__(self, iterable: Iterable[T]) -> None:
        self._iterable = iterable
        self._entered = False
        self._started = False
        self._finished = False
        self.steps = 0
        """Steps every rank ran."""
        self.ranks_out_of_data = 0
        """How many ranks had no batch at the step where all stopped (0 = nobody stopped early)."""
        self.skipped_batch = False
        """True on a rank that still had a batch when the others ran out (that batch is skipped)."""

    def __enter__(self) -> Join[T]:
        self._entered = True
        return self

    def __iter__(self) -> Iterator[T]:
        """Sync point: all ranks, once per step (a one-number all-reduce)."""
        if not self._entered or self._started:
            raise RuntimeStateError(
                "rw.join(...) was iterated outside its `with` block, or iterated twice",
                fix="write `with rw.join(batches) as it:` then `for batch in it:`, once per "
                "pass; the `with` lets a rank that breaks out tell the others to stop too.",
                rank=comm.rank(),
            )
        self._started = True
        world = _coords.require_group("rw.join")
        it = iter(self._iterable)
        while True:
            item: Any = next(it, _END)
            have = item is not _END
            ready = comm.all_reduce(int(have), "sum") if world > 1 else int(have)
            if ready < world:
                self._finish(world - ready, have)
                return
            self.steps += 1
            yield item

    def _finish(self, out_of_data: int, had_batch: bool) -> None:
        self._finished = True
        self.ranks_out_of_data = out_of_data
        self.skipped_batch = had_batch

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Leaving the loop early (break) while the others are still stepping: vote "no batch"
        # in the all-reduce they are waiting in, so they stop at this same step.
        if exc_type is None and self._started and not self._finished:
            world = _coords.require_group("rw.join")
            ready = comm.all_reduce(0, "sum") if world > 1 else 0
            self._finish(world - ready, False)


def join(iterable: Iterable[T]) -> Join[T]:
    """Iterate uneven per-rank ``iterable``s so that all ranks stop at the same step.

    Use as ``with rw.join(batches) as it: for batch in it: ...``. See the module docs for the
    semantics. Sync point: all ranks, at every step and when leaving the ``with`` block early.
    """
    validate.iterable("iterable", iterable, where="rw.join()")
    return Join(iterable)
