"""Silent mistakes around the one-call API, made loud (docs/pitfalls.md, docs/session.md).

Each guard catches a mistake that trains without an error but trains wrong or loses work:

- ``refuse_prepared_twice``: ``rt.prepare`` given what it already prepared (one message under
  every strategy, instead of one that depends on what the first call wrapped);
- ``refuse_empty_loader``: a loader that yields no batch per epoch (``drop_last=True`` with a
  batch larger than this rank's share): the loop would never run;
- ``warn_when_original_iterated``: the ``DataLoader`` given to ``rt.prepare`` iterated
  afterwards (prepare's result not used): every rank reads the whole data set;
- ``warn_scheduler_not_saved``: a checkpoint of an optimizer that a learning-rate scheduler
  drives, without the scheduler: a resumed run restarts the schedule;
- ``refuse_loader_as_model``: ``rt.prepare(loader)`` says which call prepares a loader alone.

``warn_at_user`` points a warning at the user's own line, past torch's and rankwise's frames.
The other guards of the one-call path live beside their subject: ``first_batch.py`` (a loader
that was not split over the ranks), ``agree.py`` (per-rank batch sizes), ``saving.py`` (replicas
that drifted apart, a checkpoint folder reused without resuming).

``torch.save`` on every rank is left to ``rankwise check`` (RW008): torch writes the file from
C++, so no Python-level event shows it without patching torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from types import FrameType
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import validate
from ..data import Loader
from ..errors import ConfigError

FIX_ONCE = (
    "call rt.prepare once, and use what it returns from then on: "
    "model, opt, loader = rt.prepare(model, opt, loader)."
)
PREPARE_LOADER = "loader = rt.prepare_loader(loader)"
"""The call that prepares a loader on its own (the model was prepared already)."""
_OURS = tuple(
    os.path.join(os.path.dirname(os.path.abspath(m.__file__)), "")
    for m in (torch, sys.modules[__name__.split(".")[0]])
)
"""Frames under these folders are torch's or rankwise's; the first other one is the user's."""


def check_arguments(model: Any, optimizer: Any, global_batch_size: Any) -> None:
    """``rt.prepare``'s arguments, by type, before anything moves (``rankwise.validate``)."""
    validate.module("model", model, where="rt.prepare()")
    validate.optimizer("optimizer", optimizer, where="rt.prepare()")
    validate.integer("global_batch_size", global_batch_size, minimum=1, optional=True,
                     where="rt.prepare()", example=64)  # fmt: skip


def user_frame(depth: int = 1) -> tuple[FrameType | None, int]:
    """The first frame outside torch and rankwise, above our caller's ``depth`` levels, and
    its ``stacklevel`` as seen from that caller (for ``warnings.warn``)."""
    frame, level = sys._getframe(depth + 1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    return frame, level


def warn_at_user(message: str) -> None:
    """``warnings.warn(message)`` pointing at the user's line, whatever called us."""
    warnings.warn(message, UserWarning, stacklevel=user_frame(1)[1])


def refuse_prepared_twice(
    prepared: weakref.WeakSet, call: str = "rt.prepare", **given: Any
) -> None:
    """Raise if any of ``given`` (model=, optimizer=, loader=) went through ``rt.prepare``."""
    loader = given.get("loader")
    new_loader = loader is not None and not _member(prepared, loader)
    for what, obj in given.items():
        if obj is not None and _member(prepared, obj):
            raise ConfigError(
                f"{call}() got a {what} ({type(obj).__name__}) that is already prepared: "
                f"it was given to, or returned by, an earlier rt.prepare() call",
                fix=FIX_ONCE
                + (f" To add a loader after the model was prepared: {PREPARE_LOADER}."
                   if new_loader else ""),
            )  # fmt: skip


def _is_loader(obj: Any) -> bool:
    """A torch DataLoader, an ``rw.loader``, or a prepared loader (which holds one)."""
    return isinstance(obj, DataLoader | Loader) or isinstance(getattr(obj, "loader", None), Loader)


def refuse_loader_as_model(prepared: weakref.WeakSet, model: Any) -> None:
    """``rt.prepare(loader)``: say which call prepares it, given what was prepared before (a
    prepared model cannot go through ``rt.prepare`` again)."""
    if not _is_loader(model):
        return
    if _member(prepared, model):
        fix = "use the loader rt.prepare returned as it is: it is prepared already."
    elif any(isinstance(obj, torch.nn.Module) for obj in list(prepared)):
        fix = f"the model is prepared already, so prepare the loader on its own: {PREPARE_LOADER}."
    else:
        fix = (
            "pass the model first: model, opt, loader = rt.prepare(model, opt, loader); "
            f"or, for a loader on its own: {PREPARE_LOADER}."
        )
    raise ConfigError(
        f"rt.prepare() got a {type(model).__name__} as its model (the first argument)", fix=fix
    )


def remember_prepared(prepared: weakref.WeakSet, *objs: Any) -> None:
    for obj in objs:
        with contextlib.suppress(TypeError):  # not weak-referenceable: nothing to remember
            prepared.add(obj)


def _member(prepared: weakref.WeakSet, obj: Any) -> bool:
    try:
        return obj in prepared
    except TypeError:
        return False


def refuse_empty_loader(loader: Any, given: Any, evaluation: bool) -> None:
    """A training loader with no batch in an epoch is a loop that never runs."""
    try:
        batches = len(loader)
        samples = len(loader.sampler)
    except TypeError:  # an iterable dataset: its length is unknown until it is read
        return
    if batches or evaluation:
        return
    batch = loader.batch_size
    drop = getattr(loader.dataloader, "drop_last", False)
    spelled = f"DataLoader(batch_size={getattr(given, 'batch_size', batch)}, drop_last={drop})"
    raise ConfigError(
        f"{spelled} gives 0 batches per epoch: this process's share of the data set is "
        f"{samples} sample(s), fewer than its batch of {batch}, and drop_last=True drops the "
        f"short batch; the training loop would never run",
        fix=f"use a batch of at most {samples} sample(s) per process, or drop_last=False.",
    )


def warn_when_original_iterated(original: Any, strategy: str, world_size: int) -> None:
    """Iterating the ``DataLoader`` that ``rt.prepare`` replaced warns: prepare's result is
    unused, so every rank reads the whole data set, on the CPU. (``DataLoader.__iter__`` asks
    the instance for ``_get_iterator``; overriding it there leaves the class untouched.)"""
    if not isinstance(original, DataLoader):
        return
    get_iterator = original._get_iterator

    def warn_then_iterate() -> Any:
        warnings.warn(
            f"this DataLoader was given to rt.prepare(), which returned a new loader "
            f"(strategy={strategy!r}, {world_size} process(es): each reads its own share, "
            f"batches on the device); iterating the original instead reads the whole data set "
            f"on every process. Fix: {FIX_ONCE}",
            UserWarning,
            stacklevel=3,
        )
        return get_iterator()

    original._get_iterator = warn_then_iterate


def _has_scheduler(optimizer: Any) -> bool:
    """torch's LR schedulers record ``initial_lr`` in every group of the optimizer they drive."""
    groups = getattr(optimizer, "param_groups", None) or []
    return any("initial_lr" in g for g in groups)


def warn_scheduler_not_saved(kwargs: dict[str, Any]) -> None:
    if kwargs.get("scheduler") is None and _has_scheduler(kwargs.get("optimizer")):
        warnings.warn(
            "rt.save(): a learning-rate scheduler drives this optimizer, but the checkpoint "
            "has no scheduler, so a resumed run restarts the schedule from its first step. "
            "Fix: pass it to rt.prepare(model, opt, loader, scheduler=sched) (rt.save and "
            "rt.load then include it), or rt.save(..., scheduler=sched).",
            UserWarning,
            stacklevel=3,
        )


def refuse_batch_size_without_loader(loader: Any, global_batch_size: int | None) -> None:
    if loader is None and global_batch_size is not None:
        raise ConfigError(
            f"global_batch_size={global_batch_size} was given without a loader",
            fix="pass the loader too: rt.prepare(model, optimizer, loader, global_batch_size=...).",
        )


SMALL_BATCH = 16
"""Per-rank batches below this many samples make BatchNorm's statistics a poor estimate of the
global batch's (the usual rule: 16 to 32 samples per normalisation group)."""


def _plain_batchnorms(model: torch.nn.Module) -> list[str]:
    """Names of the BatchNorm layers that normalise each rank's batch on its own."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from ..parallel.sync_batchnorm import SyncBatchNorm

    synced = (SyncBatchNorm, torch.nn.SyncBatchNorm)
    return [
        f"{name or 'model'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, synced)
    ]


def small_batch_warning(model: torch.nn.Module, per_rank: int, ranks: int, strategy: str) -> str | None:
    """The warning for BatchNorm on a small per-rank batch, or None."""
    layers = _plain_batchnorms(model) if ranks > 1 and per_rank < SMALL_BATCH else []
    if not layers:
        return None
    more = f" and {len(layers) - 1} more" if len(layers) > 1 else ""
    return (
        f"rankwise: BatchNorm meets a small per-rank batch: {layers[0]}{more} normalise each "
        f"rank's own {per_rank} sample(s) (below {SMALL_BATCH}) under strategy={strategy!r} "
        f"with {ranks} processes, not the global batch of {per_rank * ranks}: the statistics "
        "are noisier and training differs from one process on that batch. Fix: model = "
        "rw.convert_sync_batchnorm(model) before rt.prepare (statistics over the global "
        f"batch), or a per-rank batch of at least {SMALL_BATCH}."
    )


def warn_small_batchnorm(
    rt: Any, model: torch.nn.Module, wrapped: torch.nn.Module, per_rank: int | None
) -> None:
    """Warn (rank 0, once) when plain BatchNorm in ``model`` meets a per-rank batch below
    ``SMALL_BATCH``: now when the loader says the batch size, else at the first training
    forward of ``wrapped`` (its first input's length). No sync point."""
    ranks = rt.world_size if rt.mesh is None else rt.mesh.sizes["data"]
    if rt.rank != 0 or ranks < 2 or not _plain_batchnorms(model):
        return
    if per_rank is not None:
        said = small_batch_warning(model, per_rank, ranks, rt.strategy)
        if said is not None:
            warn_at_user(said)
        return
    handle = None

    def first_forward(module: torch.nn.Module, args: tuple) -> None:
        if not module.training:
            return
        handle.remove()
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        said = None if first is None else small_batch_warning(model, first.shape[0], ranks, rt.strategy)
        if said is not None:
            warn_at_user(said)

    handle = wrapped.register_forward_pre_hook(first_forward)
