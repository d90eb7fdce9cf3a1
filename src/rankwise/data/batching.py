"""``rw.loader``: a DataLoader whose batch size says what it means.

Pitfall 4 (docs/pitfalls.md#pitfall-4): ``batch_size=30`` is 30 in total with DataParallel (15 per device on two
devices) but 30 *per process* with DDP (60 in total). ``rw.loader`` takes exactly one of
``batch_size`` (always per device) or ``global_batch_size`` (always per optimizer step over the
whole job) and derives the rest, for both modes:

    replicas              = num_replicas (processes) x replicas_in_process (DataParallel devices)
    per_device_batch_size = batch_size, or global_batch_size / replicas
    loader batch          = per_device_batch_size x replicas_in_process   (what one process gets)
    global_batch_size     = per_device_batch_size x replicas

Pitfall 3 (docs/pitfalls.md#pitfall-3): the loader builds the ``DistributedSampler`` itself and puts ``shuffle``
in it; ``shuffle=True`` together with a ``sampler`` is refused, and so is a sampler that does not
split the data when several processes run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from ..errors import ConfigError
from . import _coords
from .iterable import ShardedIterable
from .sampler import DistributedSampler


def per_device_batch(
    batch_size: int | None,
    global_batch_size: int | None,
    num_replicas: int,
    replicas_in_process: int = 1,
) -> int:
    """The per-device batch implied by exactly one of the two sizes; errors say the fix."""
    _check_positive("replicas_in_process", replicas_in_process, "2 (devices DataParallel uses)")
    replicas = num_replicas * replicas_in_process
    if batch_size is not None and global_batch_size is not None:
        raise ConfigError(
            f"both batch_size={batch_size} and global_batch_size={global_batch_size} were given",
            fix=f"pass exactly one: batch_size is per device, global_batch_size is per step over "
            f"all {replicas} replica(s) (e.g. global_batch_size={global_batch_size} alone).",
        )
    if batch_size is None and global_batch_size is None:
        raise ConfigError(
            "neither batch_size nor global_batch_size was given",
            fix=f"pass exactly one: batch_size= (samples per device per step) or "
            f"global_batch_size= (samples per step over all {replicas} replica(s)).",
        )
    name, value = (
        ("batch_size", batch_size)
        if batch_size is not None
        else ("global_batch_size", global_batch_size)
    )
    _check_positive(name, value, "32")
    if batch_size is not None:
        return batch_size
    if global_batch_size % replicas:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide evenly over {replicas} "
            f"replicas ({num_replicas} process(es) x {replicas_in_process} device(s) each)",
            fix=f"use global_batch_size={_nearest(global_batch_size, replicas)}, or pass "
            "batch_size= (per device) instead.",
        )
    return global_batch_size // replicas


def _check_positive(name: str, value: Any, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name}={value!r} must be a positive integer", fix=f"pass e.g. {name}={example}."
        )


def _nearest(value: int, replicas: int) -> str:
    below = value // replicas * replicas
    above = below + replicas
    choices = [v for v in (below, above) if v > 0]
    return " or ".join(f"{v} ({v // replicas} per device)" for v in choices)


class Loader:
    """Batches for this process, with the batch contract as attributes.

    Iterate it like a DataLoader. Each new pass uses the next epoch's order unless
    ``set_epoch`` was called (so forgetting ``set_epoch`` cannot repeat the order).
    ``state_dict()`` counts the batches the loop has received, so a resume is exact even with
    prefetching workers.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        *,
        per_device_batch_size: int,
        num_replicas: int,
        replicas_in_process: int,
        generator_seed: int | None = None,
    ) -> None:
        self.dataloader = dataloader
        # DataLoader draws its workers' base seed from its generator, or else from torch's
        # global RNG, at every iter(): a draw a resumed run would not repeat in the same place.
        # With our own generator, reseeded per epoch, the global stream stays untouched.
        self._generator_seed = generator_seed
        self.per_device_batch_size = per_device_batch_size
        """Samples each device (each model replica) computes per step."""
        self.num_replicas = num_replicas
        """Processes in the job, each with its own share of the data."""
        self.replicas_in_process = replicas_in_process
        """Devices this process splits each batch over (DataParallel); 1 with DDP."""
        self.epoch = 0
        self._explicit = False  # set_epoch/load_state_dict called since the last pass began
        self._iterated = False
        self._in_pass = False  # a pass of self.epoch has begun (its progress is ours to report)
        self._consumed = 0
        self._batches = 0
        self._skip_batches = 0

    @property
    def batch_size(self) -> int:
        """Samples per batch this process receives: per device x replicas_in_process."""
        return self.per_device_batch_size * self.replicas_in_process

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over the whole job."""
        return self.batch_size * self.num_replicas

    @property
    def dataset(self) -> Any:
        return self.dataloader.dataset

    @property
    def sampler(self) -> Any:
        return self.dataloader.sampler

    def __len__(self) -> int:
        return len(self.dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order for the next pass; same on every rank. No sync point."""
        if epoch != self.epoch:
            self._skip_batches = 0
        self.epoch = epoch
        for part in (self.sampler, self.dataset):
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)
        self._explicit = True
        self._in_pass = False

    def __iter__(self) -> Iterator[Any]:
        if self._iterated and not self._explicit:
            self.set_epoch(self.epoch + 1)
        self._iterated, self._explicit, self._in_pass = True, False, True
        start = getattr(self.sampler, "start_position", 0)
        epoch_len = (
            start + len(self.sampler) if isinstance(self.sampler, DistributedSampler) else None
        )
        skip, self._skip_batches = self._skip_batches, 0
        self._consumed, self._batches = start, skip
        if self._generator_seed is not None:
            self.dataloader.generator.manual_seed(
                (self._generator_seed * 1_000_003 + self.epoch) % (2**63)
            )
        it = iter(self.dataloader)
        for _ in range(skip):
            next(it, None)
        for batch in it:
            self._batches += 1
            consumed = start + (self._batches - skip) * self.batch_size
            self._consumed = consumed if epoch_len is None else min(consumed, epoch_len)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the samples/batches the loop has received; the same on every rank."""
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self._batches}
        if not self._in_pass:
            state["batches"] = self._skip_batches
        if hasattr(self.sampler, "state_dict"):
            sampler_state = dict(self.sampler.state_dict())
            if self._in_pass and "position" in sampler_state:
                sampler_state["position"] = self._consumed
            state["sampler"] = sampler_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass continues ``state``'s epoch where the saved run stopped."""
        self.set_epoch(state["epoch"])
        if "sampler" in state and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        else:  # streams and foreign samplers: re-read the epoch and skip what was consumed
            self._skip_batches = state.get("batches", 0)


def loader(
    dataset: Any,
    *,
    batch_size: int | None = None,
    global_batch_size: int | None = None,
    shuffle: bool = False,
    drop_last: bool = False,
    seed: int = 0,
    sampler: Sampler | None = None,
    evaluation: bool = False,
    replicas_in_process: int = 1,
    num_replicas: int | None = None,
    rank: int | None = None,
    shard: bool = True,
    **dataloader_kwargs: Any,
) -> Loader:
    """A DataLoader over this rank's share of ``dataset``, with an explicit batch contract.

    Exactly one of ``batch_size`` (per device) or ``global_batch_size`` (per step, whole job).
    ``shuffle``/``seed``/``drop_last`` configure the ``DistributedSampler`` the loader builds
    (``drop_last`` also drops the last incomplete batch). ``evaluation=True`` neither pads nor
    drops: each sample is seen once; combine with ``rw.gather_for_metrics``.
    ``replicas_in_process`` is the number of devices a ``rw.DataParallel`` model in this process
    splits each batch over: the loader batch is then that process's whole (global at world
    size 1) batch. ``num_replicas``/``rank`` default to the runtime's. Iterable datasets are
    sharded by rank and worker unless ``shard=False`` (the dataset shards itself). Other keyword
    arguments go to ``torch.utils.data.DataLoader``. No sync point.
    """
    rank, num_replicas = _coords.resolve(num_replicas, rank)
    per_device = per_device_batch(batch_size, global_batch_size, num_replicas, replicas_in_process)
    _check_kwargs(dataloader_kwargs, shuffle, sampler, evaluation, drop_last)
    process_batch = per_device * replicas_in_process
    dataset, sampler = _share(
        dataset, sampler, num_replicas, rank, shuffle, seed, drop_last, evaluation, shard,
        process_batch,
    )  # fmt: skip
    own_generator = dataloader_kwargs.get("generator") is None
    if own_generator:
        dataloader_kwargs["generator"] = torch.Generator()
    dl = DataLoader(
        dataset, batch_size=process_batch, sampler=sampler, drop_last=drop_last, **dataloader_kwargs
    )
    return Loader(
        dl,
        per_device_batch_size=per_device,
        num_replicas=num_replicas,
        replicas_in_process=replicas_in_process,
        generator_seed=seed * 8191 + rank if own_generator else None,
    )


def _share(
    dataset: Any, sampler: Sampler | None, num_replicas: int, rank: int, shuffle: bool,
    seed: int, drop_last: bool, evaluation: bool, shard: bool, chunk: int,
) -> tuple[Any, Sampler | None]:  # fmt: skip
    """This rank's share of ``dataset``: a sharded stream, or our ``DistributedSampler`` (a
    sampler the user gave is checked instead)."""
    if isinstance(dataset, IterableDataset):
        _check_iterable(dataset, shuffle, sampler)
        if shard and not isinstance(dataset, ShardedIterable):
            dataset = ShardedIterable(dataset, num_replicas, rank, even=not evaluation, chunk=chunk)
    elif sampler is None:
        sampler = DistributedSampler(
            dataset,
            num_replicas,
            rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pad=not evaluation,
        )
    else:
        _check_sampler(sampler, num_replicas)
    return dataset, sampler


def _check_kwargs(
    kwargs: dict[str, Any], shuffle: bool, sampler: Any, evaluation: bool, drop_last: bool
) -> None:
    if "batch_sampler" in kwargs:
        raise ConfigError(
            "batch_sampler= was given to rw.loader; it would bypass the batch-size contract",
            fix="pass sampler= with batch_size= or global_batch_size=, or use "
            "torch.utils.data.DataLoader directly for a custom batch sampler.",
        )
    if shuffle and sampler is not None:
        raise ConfigError(
            f"shuffle=True was given together with sampler={type(sampler).__name__}(...); "
            "the sampler decides the order",
            fix="drop shuffle=True and build the sampler with shuffle=True "
            "(rw.DistributedSampler(dataset, shuffle=True)), or drop sampler= and let rw.loader "
            "build one.",
        )
    if evaluation and (shuffle or drop_last):
        raise ConfigError(
            f"evaluation=True was given with shuffle={shuffle}, drop_last={drop_last}",
            fix="evaluation visits every sample once, in dataset order: leave shuffle and "
            "drop_last False.",
        )


def _check_iterable(dataset: Any, shuffle: bool, sampler: Any) -> None:
    if sampler is not None or shuffle:
        what = "sampler=" if sampler is not None else "shuffle=True"
        raise ConfigError(
            f"{what} was given for the iterable dataset {type(dataset).__name__}, which has no "
            "indices to sample",
            fix="shuffle inside the dataset (e.g. a shuffle buffer seeded by its set_epoch(), "
            "which the loader calls every epoch) and leave shuffle/sampler unset.",
        )


def _check_sampler(sampler: Sized, num_replicas: int) -> None:
    theirs = getattr(sampler, "num_replicas", None)
    if num_replicas > 1 and theirs != num_replicas:
        raise ConfigError(
            f"sampler={type(sampler).__name__}(...) splits the data over num_replicas={theirs}, "
            f"but {num_replicas} processes run: every process would read "
            f"{'all' if theirs is None else 'the wrong share'} of the data",
            fix="use rw.DistributedSampler(dataset, shuffle=...) (or leave sampler= unset), or "
            "give your sampler a num_replicas attribute equal to the world size.",
        )
