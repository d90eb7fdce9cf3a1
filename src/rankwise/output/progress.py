"""``rw.progress(loader)``: one progress bar for the whole job, on rank 0, in global samples/s."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from .. import validate
from ..comm import collectives as comm
from .log import finish_bar, make_bar, open_bars

T = TypeVar("T")


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (nested tuples/dicts too)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = _batch_len(item)
            if n:
                return n
    return 0


class _Counted:
    """Yields from ``iterable`` and updates a tqdm bar with global samples/s."""

    def __init__(self, iterable: Iterable[T], bar: Any, replicas: int, lines: bool) -> None:
        self.iterable, self.bar, self.replicas = iterable, bar, replicas
        self.lines = lines  # the bar writes whole lines (_LineFile), not in place

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        start, samples = time.perf_counter(), 0
        if not self.lines:
            open_bars.add(self.bar)
        try:
            for batch in self.iterable:
                yield batch
                samples += _batch_len(batch) * self.replicas
                elapsed = max(time.perf_counter() - start, 1e-9)
                self.bar.set_postfix_str(
                    f"{samples / elapsed:,.0f} samples/s (global)", refresh=False
                )
                self.bar.update(1)
        finally:
            open_bars.discard(self.bar)
            finish_bar(self.bar, self.lines)


def progress(
    iterable: Iterable[T],
    *,
    desc: str | None = None,
    total: int | None = None,
    replicas: int | None = None,
    **tqdm_kwargs: Any,
) -> Iterable[T]:
    """Iterate ``iterable``; on rank 0 show a tqdm bar with the job's global samples/s.

    Other ranks get the iterable back untouched (no bar, no output). ``replicas`` is how many
    processes each see a batch of that size (the world size, the default, for DDP; 1 when the
    batch is already global, as with DataParallel).
    """
    validate.iterable("iterable", iterable, where="rw.progress()")
    validate.text("desc", desc, optional=True, where="rw.progress()")
    validate.integer("total", total, minimum=0, optional=True, where="rw.progress()")
    validate.integer("replicas", replicas, minimum=1, optional=True, where="rw.progress()")
    if comm.rank() != 0:
        return iterable
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    bar, lines = make_bar(total, desc, "batch", sys.stdout, tqdm_kwargs)
    replicas = comm.world_size() if replicas is None else replicas
    return _Counted(iterable, bar, replicas, lines)
