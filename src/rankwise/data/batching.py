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
from . import _coords, _resume
from .contract import check_built_loader, check_loader_arguments, per_device_batch
from .iterable import ShardedIterable
from .sampler import DistributedSampler
from .seeding import default_seed


class Loader:
    """Batches for this process, with the batch contract as attributes.

    Iterate it like a DataLoader. The epoch contract (docs/data.md):

    - ``set_epoch(e)`` (on the loader or on its sampler) makes the next pass read epoch ``e``;
    - a pass that ran to its end moves the next pass to the following epoch, unless
      ``set_epoch`` is called first (so forgetting ``set_epoch`` cannot repeat the order);
    - a pass left early (``next(iter(loader))`` to peek, a ``break``) moves nothing: the next
      pass reads the same epoch again from where that pass began, as torch's DataLoader does.

    ``state_dict()`` describes what the next batches will be: mid-pass, the rest of the epoch
    (counting the batches the loop received, so a resume is exact even with prefetching
    workers); after a finished pass, the next epoch from its start.
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
        check_built_loader(dataloader, {"per_device_batch_size": per_device_batch_size,
                           "num_replicas": num_replicas, "replicas_in_process": replicas_in_process},
                           generator_seed)  # fmt: skip
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
        """The epoch of the pass under way, or of the next pass."""
        self.finished_epoch: int | None = None
        """After ``load_state_dict``: the epoch the saved run had finished (until ``set_epoch``)."""
        self._explicit = False  # set_epoch/load_state_dict called since the last pass began
        self._completed = False  # the last pass ran to its end
        self._live = 0  # id of the pass under way (0: none); a peek's iterator may linger
        self._passes = 0
        self._consumed = 0
        self._batches = 0
        self._skip_batches = 0
        self._end: int | None = None

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
        """Use epoch ``epoch``'s order for the next pass; same on every rank. No sync point.

        After ``load_state_dict``, the saved epoch continues where the saved run stopped.
        """
        if epoch != self.epoch:
            self._skip_batches = 0
        self.epoch = epoch
        for part in (self.sampler, self.dataset):
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)
        self._explicit, self._completed = True, False
        if self.finished_epoch is not None:
            if _resume.check_first_epoch(epoch, self.finished_epoch):
                self._exhaust(epoch)
            self.finished_epoch = None

    def _exhaust(self, epoch: int) -> None:
        """Nothing is left of ``epoch``: the resumed checkpoint had finished it."""
        if isinstance(self.sampler, DistributedSampler):
            state = self.sampler.state_dict()
            n = self.sampler.num_samples
            self.sampler.load_state_dict({**state, "epoch": epoch, "offset": 0, "position": n})
        else:
            self._skip_batches = len(self.dataloader)

    def _begin_pass(self) -> tuple[int, dict[str, Any] | None]:
        """Decide the pass's epoch; return its id and the state to go back to if it is left."""
        sampler_set = getattr(self.sampler, "_epoch_set", False)  # sampler.set_epoch() called
        if sampler_set and (not self._explicit or self.sampler.epoch != self.epoch):
            self.set_epoch(self.sampler.epoch)
        elif self._completed and not self._explicit:
            self.set_epoch(self.epoch + 1)
        elif not self._explicit and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)  # the same epoch again, on purpose: no warning
        self._explicit = self._completed = False
        restart = self.state_dict()
        self._passes += 1
        self._live = self._passes
        try:
            self._end = len(self.dataloader)  # batches this pass will hand out
        except TypeError:  # a stream without a length
            self._end = None
        return self._passes, restart

    def __iter__(self) -> Iterator[Any]:
        pass_id, restart = self._begin_pass()
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
        try:
            for batch in it:
                self._batches += 1
                consumed = start + (self._batches - skip) * self.batch_size
                self._consumed = consumed if epoch_len is None else min(consumed, epoch_len)
                yield batch
            self._completed = self._live == pass_id
            self.finished_epoch = None
        finally:
            if self._live == pass_id:
                self._live = 0
                if not self._completed and not self._explicit:
                    self._restore(restart)  # left early: the next pass begins where this one did

    def _restore(self, state: dict[str, Any]) -> None:
        finished = self.finished_epoch  # a peek right after resuming keeps the resume's facts
        self.load_state_dict(state)
        self.finished_epoch = finished
        self._explicit = False  # as if never iterated: a later sampler.set_epoch still counts
        if hasattr(self.sampler, "_epoch_set"):
            self.sampler._epoch_set = False

    def _pass_done(self) -> bool:
        """The pass under way has handed out its last batch (its future is the next epoch)."""
        return self._end is not None and self._batches >= self._end

    def state_dict(self) -> dict[str, Any]:
        """What the next batches are: the epoch and how far into it; the same on every rank."""
        if (self._completed and not self._explicit) or (self._live and self._pass_done()):
            return self._next_epoch_state()
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self._skip_batches}
        if self.finished_epoch is not None:
            state["finished_epoch"] = self.finished_epoch
        if self._live:
            state["batches"] = self._batches
        if hasattr(self.sampler, "state_dict"):
            sampler_state = dict(self.sampler.state_dict())
            if self._live and "position" in sampler_state:
                sampler_state["position"] = self._consumed
            state["sampler"] = sampler_state
        return state

    def _next_epoch_state(self) -> dict[str, Any]:
        done = self.epoch
        state: dict[str, Any] = {"epoch": done + 1, "batches": 0, "finished_epoch": done}
        if hasattr(self.sampler, "state_dict"):
            sampler_state = dict(self.sampler.state_dict())
            sampler_state.update(epoch=done + 1, offset=0, position=0)
            state["sampler"] = sampler_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass continues ``state``'s epoch where the saved run stopped.

        A state saved after an epoch finished resumes at the start of the next epoch, and
        ``finished_epoch`` names the finished one.
        """
        self.finished_epoch = None
        self.set_epoch(state["epoch"])
        if "sampler" in state and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        else:  # streams and foreign samplers: re-read the epoch and skip what was consumed
            self._skip_batches = state.get("batches", 0)
        self.finished_epoch = state.get("finished_epoch")
        ours = isinstance(self.sampler, DistributedSampler) and "sampler" in state
        if self.finished_epoch is None and ours and len(self.sampler) == 0 < len(self.dataset):
            # Saved at the very end of an epoch by an older rankwise: go on with the next one.
            self.set_epoch(state["epoch"] + 1)
            self.finished_epoch = state["epoch"]


def loader(
    dataset: Any,
    *,
    batch_size: int | None = None,
    global_batch_size: int | None = None,
    shuffle: bool = False,
    drop_last: bool = False,
    seed: int | None = None,
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
    (``seed`` by default ``rw.seed_everything``'s, else 0, also seeds the workers with the rank
    and epoch; ``drop_last`` also drops the last incomplete batch). ``evaluation=True`` neither
    pads nor drops: each sample is seen once; combine with ``rw.gather_for_metrics``.
    ``replicas_in_process`` is the number of devices a ``rw.DataParallel`` model in this process
    splits each batch over: the loader batch is then that process's whole (global at world
    size 1) batch. ``num_replicas``/``rank`` default to the runtime's. Iterable datasets are
    sharded by rank and worker unless ``shard=False`` (the dataset shards itself). Other keyword
    arguments go to ``torch.utils.data.DataLoader``. No sync point.
    """
    rank, num_replicas = _coords.resolve(num_replicas, rank)
    seed = default_seed() if seed is None else seed
    per_device = per_device_batch(batch_size, global_batch_size, num_replicas, replicas_in_process)
    _check_kwargs(dataloader_kwargs, shuffle, sampler, evaluation, drop_last, dataset, seed)
    _check_not_empty(dataset)
    process_batch = per_device * replicas_in_process
    dataset, sampler = _share(dataset, sampler, num_replicas, rank, shuffle, seed, drop_last,
                              evaluation, shard, process_batch)  # fmt: skip
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


def _check_not_empty(dataset: Any) -> None:
    """An empty map-style data set would give 0 batches every epoch, silently."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return
    if len(dataset) == 0:
        raise ConfigError(
            f"rw.loader got an empty data set ({type(dataset).__name__} of length 0): every "
            "epoch would have 0 batches and training would silently do nothing",
            fix="check the path, split or filter that built the data set (len(dataset) must be "
            "at least 1).",
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
    kwargs: dict[str, Any], shuffle: bool, sampler: Any, evaluation: bool, drop_last: bool,
    dataset: Any, seed: Any,
) -> None:  # fmt: skip
    check_loader_arguments(dataset, seed, sampler)  # by type first (validate.py)
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
