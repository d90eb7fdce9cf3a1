"""Iterable datasets: each rank, and each DataLoader worker inside it, reads its own items.

A stream has no indices to sample, so every rank reads the whole stream and keeps its share:
item ``i`` goes to rank ``i % num_replicas`` (the same striding as ``DistributedSampler``).
Inside a rank the kept items go to the DataLoader's workers in runs of ``chunk`` items, round
robin; with ``chunk`` equal to the batch size each worker builds whole batches of consecutive
items, and the DataLoader, which takes batches from its workers in turn, hands them out in
stream order. Without sharding by worker every worker would yield the whole share again.

``even=True`` (training) keeps only complete groups of ``num_replicas`` items, so every rank
gets the same number of items (dropping at most ``num_replicas - 1``), hence the same number of
batches. ``even=False`` (evaluation) keeps every item; ranks then differ by at most one item.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from .. import validate
from ..errors import ConfigError
from . import _coords
from .sampler import share_size

_NOTHING = object()


class ShardedIterable(IterableDataset):
    """Wrap an iterable dataset so each (rank, DataLoader worker) yields a disjoint share."""

    def __init__(
        self,
        dataset: Iterable[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        even: bool = False,
        chunk: int = 1,
    ) -> None:
        if not hasattr(dataset, "__iter__"):
            validate.fail("dataset", dataset, "an iterable", where="ShardedIterable()",
                          fix="pass the stream (an IterableDataset or any iterable).")  # fmt: skip
        self.rank, self.num_replicas = _coords.resolve(num_replicas, rank)
        if not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(
                f"chunk={chunk!r} must be a positive integer",
                fix="pass the loader's batch size (or leave the default 1).",
            )
        self.dataset = dataset
        self.even = even
        self.chunk = chunk

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to the wrapped dataset, if it shuffles by epoch."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        """Items this rank yields; only when the wrapped dataset has a length."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.even:
            n = n // self.num_replicas * self.num_replicas
        return share_size(n, self.num_replicas, self.rank)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        world, rank = self.num_replicas, self.rank
        held: Any = _NOTHING
        for i, item in enumerate(self.dataset):
            slot = i % world
            if slot == rank and (i // world // self.chunk) % workers == worker:
                if not self.even:
                    yield item
                    continue
                held = item
            # In even mode an item is released only once its group of `world` items is complete.
            if self.even and slot == world - 1 and held is not _NOTHING:
                yield held
                held = _NOTHING
