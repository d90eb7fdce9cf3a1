"""``DistributedSampler``: torch's partition, plus a warning, an evaluation mode and exact resume.

The partition is torch's, index for index, for the same arguments (so switching changes nothing):
one permutation per epoch from ``torch.randperm`` seeded with ``seed + epoch`` (or ``range(n)``),
padded by repeating its start (or cut, with ``drop_last``) to a multiple of ``num_replicas``,
and rank ``r`` takes every ``num_replicas``-th index starting at ``r``. Every rank therefore gets
the same number of samples, so the same number of batches: nobody waits for a batch that never
comes.

What torch does not do:
- a warning when a shuffling sampler starts a second pass without ``set_epoch`` (torch silently
  repeats the same order every epoch);
- ``pad=False``, the evaluation mode: no padding and no dropping, so every sample is seen exactly
  once (ranks then differ by at most one sample; see ``gather_for_metrics``);
- ``state_dict()``/``load_state_dict()``: the epoch and how far this epoch has got, so a resumed
  run sees exactly the samples it had not seen. The state is the same on every rank (all ranks
  advance together), so rank 0 alone can save it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from .. import validate
from ..errors import ConfigError, RuntimeStateError, warn_user
from . import _coords


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's order of all ``n`` indices, exactly as torch's sampler draws it."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def layout_size(n: int, world: int, drop_last: bool, pad: bool) -> int:
    """Length of the global list: ``n`` rounded up (pad), down (drop_last), or kept (neither)."""
    if not pad:
        return n
    if drop_last:
        return n // world * world
    return -(-n // world) * world


def arrange(order: list[int], world: int, drop_last: bool, pad: bool) -> list[int]:
    """The global list ranks take turns on: torch pads by cycling from the start of ``order``."""
    total = layout_size(len(order), world, drop_last, pad)
    if total <= len(order):
        return order[:total]
    return order + [order[i % len(order)] for i in range(total - len(order))]


def share_size(total: int, world: int, rank: int) -> int:
    """How many of ``total`` strided positions ``rank, rank + world, ...`` exist."""
    return max(0, -(-(total - rank) // world))


class DistributedSampler(Sampler[int]):
    """Each rank's share of the dataset; drop-in for ``torch.utils.data.DistributedSampler``.

    ``num_replicas`` and ``rank`` default to the runtime's (or the launcher's) world size and
    rank; world size 1 unlaunched is the normal case. ``pad=False`` (keyword only) is the
    evaluation mode: neither pads nor drops, so each sample is seen exactly once.

    Call ``set_epoch(epoch)`` before each epoch; ``rw.loader`` does it for you.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            validate.fail("dataset", dataset, "a data set with len()", where="DistributedSampler()",
                          fix="pass the map-style data set the DataLoader reads.")  # fmt: skip
        validate.integer("seed", seed, where="DistributedSampler()")
        self.rank, self.num_replicas = _coords.resolve(num_replicas, rank)
        if drop_last and not pad:
            raise ConfigError(
                "drop_last=True and pad=False were both given",
                fix="pad=False (evaluation) keeps every sample exactly once; drop_last=True cuts "
                "the tail for training. Pick one.",
            )
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self._n = len(dataset)
        self.total_size = layout_size(self._n, self.num_replicas, drop_last, pad)
        self.num_samples = share_size(self.total_size, self.num_replicas, self.rank)
        # Where the current (or last) pass of self.epoch started in the epoch's order, and how
        # many of this rank's indices it has handed out; _pending is a resume not yet started.
        self._offset = 0
        self._position = 0
        self._pending: tuple[int, int] | None = None
        self._iterated = False
        self._epoch_set = False
        self._warned = False

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order for the next pass (the same on every rank).

        A resume loaded by ``load_state_dict`` for this same epoch is kept, so the usual loop
        ``for epoch in range(start, n): sampler.set_epoch(epoch)`` continues mid-epoch.
        """
        if self._pending is None or epoch != self.epoch:
            self._pending = None
            self._offset = self._position = 0
        self.epoch = epoch
        self._epoch_set = True

    @property
    def start_position(self) -> int:
        """How many of this rank's indices of the epoch the next pass skips (non-zero on resume)."""
        return 0 if self._pending is None else self._pending[1]

    def __len__(self) -> int:
        """Indices the next pass yields (fewer than ``num_samples`` when resuming mid-epoch)."""
        if self._pending is None:
            return self.num_samples
        offset, position = self._pending
        return max(0, self._share_len(offset) - position)

    def _share_len(self, offset: int) -> int:
        total = layout_size(self._n - offset, self.num_replicas, self.drop_last, self.pad)
        return share_size(total, self.num_replicas, self.rank)

    def __iter__(self) -> Iterator[int]:
        if len(self.dataset) != self._n:
            raise RuntimeStateError(
                f"the dataset had {self._n} samples when the sampler was built and has "
                f"{len(self.dataset)} now",
                fix="build a new DistributedSampler (or rw.loader) after changing the dataset.",
                rank=self.rank,
            )
        self._warn_if_epoch_repeats()
        offset, position = self._pending or (0, 0)
        self._pending = None
        order = epoch_order(self._n, self.shuffle, self.seed, self.epoch)[offset:]
        mine = arrange(order, self.num_replicas, self.drop_last, self.pad)[
            self.rank :: self.num_replicas
        ]
        self._offset, self._position = offset, position
        return self._emit(mine, position)

    def _emit(self, mine: list[int], start: int) -> Iterator[int]:
        for i in range(start, len(mine)):
            self._position = i + 1  # counted when handed out
            yield mine[i]

    def _warn_if_epoch_repeats(self) -> None:
        if self.shuffle and self._iterated and not self._epoch_set and not self._warned:
            self._warned = True
            warn_user(  # at the user's loop, not inside torch's DataLoader
                f"DistributedSampler: a new pass over the data started with epoch={self.epoch} "
                "again, so it repeats the previous pass's shuffled order (set_epoch() was not "
                "called). Fix: call sampler.set_epoch(epoch) at the start of every epoch, or use "
                "rw.loader(...), which does it for you."
            )
        self._iterated = True
        self._epoch_set = False

    def state_dict(self) -> dict[str, Any]:
        """Epoch and progress, enough to resume exactly; identical on every rank.

        ``position`` counts indices handed out by this sampler. A ``DataLoader`` draws indices
        ahead of the training loop (prefetching), so save ``rw.loader(...).state_dict()``,
        which counts the batches the loop received, when the sampler sits inside a DataLoader.
        """
        offset, position = self._pending or (self._offset, self._position)
        return {
            "epoch": self.epoch,
            "offset": offset,
            "position": position,
            "num_replicas": self.num_replicas,
            "dataset_size": self._n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "pad": self.pad,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass continues ``state``'s epoch with the indices not yet seen.

        With the same ``num_replicas`` the continuation is exactly the uninterrupted run's.
        With another world size, the samples the old job had not reached are re-partitioned
        over the new ranks.
        """
        self._check_compatible(state)
        offset, position = state.get("offset", 0), state["position"]
        old_world = state.get("num_replicas", self.num_replicas)
        if old_world != self.num_replicas:
            offset, position = min(offset + position * old_world, self._n), 0
        self.epoch = state["epoch"]
        self._pending = (offset, position)
        self._offset, self._position = offset, position
        self._epoch_set = True

    def _check_compatible(self, state: dict[str, Any]) -> None:
        for key in ("dataset_size", "seed", "shuffle", "drop_last", "pad"):
            mine = self._n if key == "dataset_size" else getattr(self, key)
            if state.get(key, mine) != mine:
                raise ConfigError(
                    f"cannot resume exactly: the saved sampler state has {key}={state[key]!r}, "
                    f"this sampler has {key}={mine!r}",
                    fix=f"build the sampler with the same {key} as the run that saved it, or "
                    "start the epoch over with set_epoch(epoch) instead of load_state_dict.",
                    rank=self.rank,
                )
