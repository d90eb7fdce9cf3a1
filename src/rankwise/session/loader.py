"""The loader: a plain DataLoader rebuilt as ``rw.loader`` with an explicit batch meaning, and
batches moved to the device (docs/pitfalls.md#pitfall-3 and #pitfall-4)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from .. import validate
from ..data import Loader
from ..data import loader as make_loader
from ..errors import ConfigError
from ..output.log import get_logger
from ..parallel.dp.scatter_gather import to_device
from ..runtime import Runtime
from ..strategies import get as get_strategy
from ..timing import clock as timing
from ..validate import shown
from .agree import agree_batches, uneven_line, uneven_warning
from .guards import refuse_empty_loader, warn_at_user


def _shuffle_of(dl: DataLoader) -> bool:
    """shuffle=True/False from torch's default samplers; anything else is refused."""
    sampler = dl.sampler
    if dl.batch_size is None:
        what = "batch_sampler=" if dl.batch_sampler is not None else "batch_size=None"
        raise ConfigError(
            f"rt.prepare() cannot re-create a DataLoader built with {what}: the batches are "
            "not described by a batch size it could split over the replicas",
            fix="build the loader yourself with rw.loader(dataset, batch_size=..., sampler=...) "
            "and pass it to rt.prepare (an rw.loader is kept as it is).",
        )
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return True
    name = type(sampler).__name__
    if "DistributedSampler" in name:
        fix = (
            "rt.prepare builds the distributed sampler itself: pass DataLoader(dataset, "
            "batch_size=B, shuffle=True) without sampler=."
        )
    else:
        fix = (
            "build the loader yourself: rw.loader(dataset, batch_size=B, sampler=...) with a "
            "sampler that splits the data over the ranks, and pass that to rt.prepare."
        )
    raise ConfigError(
        f"rt.prepare() cannot re-create DataLoader(sampler={name}(...)): only shuffle=True "
        "or shuffle=False (RandomSampler / SequentialSampler) can be split over the ranks "
        "without changing what the sampler means",
        fix=fix,
    )


def _dataloader_kwargs(dl: DataLoader) -> dict[str, Any]:
    """Everything of ``dl`` except what the sampler and the batch contract decide."""
    keys = (
        "num_workers",
        "collate_fn",
        "pin_memory",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    )
    return {k: getattr(dl, k) for k in keys if hasattr(dl, k)}


def _rebuild(
    rt: Runtime, dl: DataLoader, global_batch_size: int | None, evaluation: bool
) -> Loader:
    shuffle = _shuffle_of(dl)
    in_process = rt.replicas_in_process
    batch_size = dl.batch_size if global_batch_size is None else None
    if batch_size is not None and rt.strategy_spec.batch_meaning == "split_over_devices":
        # torch's DataParallel meaning: the loader's batch is the global batch, split.
        if dl.batch_size % in_process:
            below = dl.batch_size // in_process * in_process
            raise ConfigError(
                f"DataLoader(batch_size={dl.batch_size}) is the global batch under "
                f"strategy='dp' and does not split evenly over {in_process} devices",
                fix=f"use batch_size={below or in_process} or {below + in_process}, or "
                "rt.prepare(..., global_batch_size=...).",
            )
        batch_size = dl.batch_size // in_process
    return make_loader(
        dl.dataset,
        batch_size=batch_size,
        global_batch_size=global_batch_size,
        shuffle=shuffle,
        drop_last=dl.drop_last,
        evaluation=evaluation,
        replicas_in_process=in_process,
        **_dataloader_kwargs(dl),
    )


def describe_batch(strategy: str, loader: Loader, source: str) -> str:
    """The log line that says what the batch size means (``source``: how it was given)."""
    g, b, per = loader.global_batch_size, loader.batch_size, loader.per_device_batch_size
    meaning = get_strategy(strategy).batch_meaning
    if meaning == "per_process":
        split = f"global batch {g} = {b} per process x {loader.num_replicas} processes"
    elif meaning == "split_over_devices":
        split = f"global batch {g} = {per} per device x {loader.replicas_in_process} devices"
    else:
        split = f"global batch {g}"
    return f"rankwise prepare [{strategy}]: {source}: {split}"


def _source(rt: Runtime, given: Any, global_batch_size: int | None) -> str:
    if isinstance(given, Loader):
        return "rw.loader kept as built"
    if global_batch_size is not None:
        unused = given.batch_size != global_batch_size
        return f"global_batch_size={global_batch_size}" + (
            f" (the DataLoader's batch_size={given.batch_size} is not used)" * unused
        )
    return get_strategy(rt.strategy).batch_phrase(given.batch_size)


def _check_kept(rt: Runtime, kept: Loader, global_batch_size: int | None) -> None:
    in_process = rt.replicas_in_process
    if kept.replicas_in_process != in_process:
        raise ConfigError(
            f"the rw.loader was built with replicas_in_process={kept.replicas_in_process}, but "
            f"strategy={rt.strategy!r} splits each batch over {in_process} device(s)",
            fix=f"build it with replicas_in_process={in_process}, or pass a plain DataLoader "
            "and let rt.prepare build the loader.",
        )
    if global_batch_size is not None and global_batch_size != kept.global_batch_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} was given, but the rw.loader passed has "
            f"global batch {kept.global_batch_size}",
            fix="build the loader with rw.loader(..., global_batch_size=...) or drop the argument.",
        )


def prepare_loader(
    rt: Runtime,
    loader: DataLoader | Loader,
    *,
    global_batch_size: int | None = None,
    evaluation: bool = False,
    agree: bool = False,
) -> DeviceLoader:
    """``loader`` split over the replicas with our sampler; batches arrive on ``rt.device``.

    A plain ``DataLoader``'s ``batch_size`` keeps torch's meaning for the strategy (its
    registry entry's ``batch_meaning``: 'single': per step; 'ddp' and 'zero1/2/3': per
    process; 'dp': the global batch, split over the devices) unless
    ``global_batch_size`` is given. The meaning is logged once, on rank 0. ``evaluation=True``
    visits each sample exactly once (for ``rw.gather_for_metrics``). An ``rw.loader`` is kept.
    ``agree`` (``rt.prepare``'s): compare the per-process batch sizes over the ranks
    (``agree.py``), and log the global batch they really make. Sync point only with ``agree``.
    """
    validate.integer("global_batch_size", global_batch_size, minimum=1, optional=True,
                     where="rt.prepare_loader()", example=64)  # fmt: skip
    if isinstance(loader, DeviceLoader):
        loader = loader.loader
    if isinstance(loader, Loader):
        _check_kept(rt, loader, global_batch_size)
        built = loader
    elif isinstance(loader, DataLoader):
        built = _rebuild(rt, loader, global_batch_size, evaluation)
    else:
        raise ConfigError(
            f"loader={shown(loader)} ({type(loader).__name__}) is not a torch DataLoader nor "
            "an rw.loader",
            fix="pass DataLoader(dataset, batch_size=B, shuffle=...) or rw.loader(dataset, ...).",
        )
    refuse_empty_loader(built, loader, evaluation)
    batches = agree_batches(rt, built) if agree else None
    line = describe_batch(rt.strategy, built, _source(rt, loader, global_batch_size))
    if batches is not None and batches.uneven:
        line = uneven_line(rt.strategy, batches)
    if rt.mesh is not None and rt.mesh.world_size > rt.mesh.sizes["data"]:
        line += f" (data ranks of the mesh {rt.mesh.describe()}: their peers read the same)"
    get_logger("rankwise.session").info(line + (" (evaluation: each sample once)" * evaluation))
    prepared = DeviceLoader(built, rt.device)
    if batches is not None:
        prepared.agreed_global_batch_size = batches.global_batch if batches.uneven else None
        said = uneven_warning(batches, built.global_batch_size)
        if said is not None and rt.rank == 0:
            warn_at_user(said)
    return prepared


def _loaders(name: str, doc: str) -> property:
    """``DeviceLoader.<name>``: the wrapped ``rw.Loader``'s attribute, read-only."""
    return property(lambda self: getattr(self.loader, name), doc=doc)


_END = object()


class DeviceLoader:
    """An ``rw.Loader`` whose batches are moved to ``device`` (DataParallel: its output device).

    Keeps the loader's ``len``, ``set_epoch``, ``state_dict``/``load_state_dict`` (so
    checkpoints and exact resume work) and offers its batch contract and position as the
    read-only attributes below; anything else is on ``.loader`` (the ``rw.Loader``) or
    ``.dataloader`` (torch's). No sync point.
    """

    dataloader = _loaders("dataloader", "torch's DataLoader under the ``rw.Loader``.")
    dataset = _loaders("dataset", "The dataset (this rank's share of a stream, if iterable).")
    sampler = _loaders("sampler", "The sampler that splits the data over the ranks.")
    batch_size = _loaders("batch_size", "Samples per batch this process receives.")
    per_device_batch_size = _loaders("per_device_batch_size", "Samples per device per step.")
    num_replicas = _loaders("num_replicas", "Processes in the job, each with its own share.")
    replicas_in_process = _loaders("replicas_in_process", "Devices each batch is split over.")
    epoch = _loaders("epoch", "The epoch of the pass under way, or of the next pass.")
    finished_epoch = _loaders("finished_epoch", "After a resume: the epoch the run had finished.")

    def __init__(self, loader: Loader, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        self.at_last_batch = False
        """True while the epoch's last batch is out (``rt.accumulate`` synchronises on it)."""
        self.in_pass = False
        """True while a pass is under way (the first-batch check trusts these batches)."""
        self.agreed_global_batch_size: int | None = None
        """The global batch the ranks' batch sizes add up to, when ``rt.prepare`` found that
        they differ (otherwise the loader's own figure holds)."""

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, whole job."""
        return self.agreed_global_batch_size or self.loader.global_batch_size

    def __iter__(self) -> Iterator[Any]:
        try:
            total = len(self.loader)
        except TypeError:  # an iterable dataset of unknown length
            total = -1
        self.in_pass = True
        batches = iter(self.loader)
        try:
            for i in itertools.count():
                timing.begin("data")  # the step anatomy's data wait (rankwise.timing)
                try:
                    batch = next(batches, _END)
                    if batch is not _END:
                        batch = to_device(batch, self.device)
                finally:
                    timing.end("data")
                if batch is _END:
                    return
                self.at_last_batch = i + 1 == total
                yield batch
        finally:
            self.at_last_batch = self.in_pass = False

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
