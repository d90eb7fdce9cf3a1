"""``rw.save_checkpoint`` and ``rw.load_checkpoint``: one entry for both formats.

``sharded=False`` (the default of this function) writes one file from rank 0 (``single``);
``sharded=True`` writes torch DCP's folder format, every rank its own pieces in parallel
(``sharded_save``). Loading looks at what the path holds: a sharded folder (ours, or one torch's
``dcp.save`` wrote) loads through ``sharded_load``, anything else as a file (``single``).
``rt.save`` chooses the format from the strategy registry (docs/checkpoints.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import validate
from . import files, single
from .sharded.dcp_meta import is_sharded


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    loader: Any = None,
    step: int | None = None,
    epoch: int | None = None,
    keep_last: int = 3,
    sharded: bool = False,
    **extra: Any,
) -> Path:
    """Save the bare model, optimizer, scheduler, data position, RNG of every rank, and
    ``extra`` (``single.save_checkpoint``); ``sharded=True``: as a DCP folder, each rank
    writing its own shards (``ckpt-<step>/`` in a directory, or the folder ``path``).

    Sync point: all ranks — call it on every rank, never inside ``if rank == 0``.
    """
    from .background import SAVES

    files.check_arguments(path, model, optimizer, saving=True, epoch=epoch, keep_last=keep_last)
    check_flag("sharded", sharded, where="rw.save_checkpoint()")
    SAVES.wait()  # a background save in flight ends first (it may write into the same folder)
    kwargs = dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                  step=step, epoch=epoch, keep_last=keep_last)  # fmt: skip
    if sharded:
        from .sharded.save import save_sharded

        return save_sharded(path, **kwargs, **extra)
    return single.save_checkpoint(path, **kwargs, **extra)


def check_flag(name: str, value: Any, *, where: str, optional: bool = False) -> None:
    """``value`` must be True or False (or None when ``optional``): ``"no"`` is not False."""
    if not (isinstance(value, bool) or (optional and value is None)):
        validate.fail(name, value, "True or False" + (" (or None)" if optional else ""),
                      where=where, fix=f"pass {name}=True or {name}=False.")  # fmt: skip


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint a path refers to: a file, a sharded folder, or what ``latest`` names."""
    p = Path(path)
    return p if is_sharded(p) else single.resolve(p)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    loader: Any = None,
    map_location: Any = None,
    strict: bool = True,
    restore_rng: bool = True,
    trusted: bool = False,
) -> dict[str, Any]:
    """Restore what ``save_checkpoint`` saved, in either format; returns ``step``, ``epoch``,
    ``extra``, ``meta``, ``path`` (``single.load_checkpoint`` says what each means).

    A sharded folder loads at any world size, strategy or mesh: each rank reads the pieces
    it holds (``map_location`` and ``trusted`` do not apply: tensors go where the model's
    are, and nothing but tensors and plain values is ever read). A background save in flight
    is waited for first. No sync point.
    """
    from .background import SAVES

    files.check_arguments(path, model, optimizer, saving=False)
    SAVES.wait()  # a background save in flight ends first: it may be the checkpoint asked for
    found = resolve(path)
    if is_sharded(found):
        from .sharded.load import load_sharded

        return load_sharded(found, model=model, optimizer=optimizer, scheduler=scheduler,
                            loader=loader, strict=strict, restore_rng=restore_rng)  # fmt: skip
    return single.load_checkpoint(
        found, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
        map_location=map_location, strict=strict, restore_rng=restore_rng, trusted=trusted,
    )  # fmt: skip


def capture_state(*, model: nn.Module, optimizer: Any = None, scheduler: Any = None,
                  loader: Any = None, step: int | None = None, epoch: int | None = None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """This rank's training state as the single-file checkpoint holds it, with this rank's RNG
    state alone (``rng[0]``) and nothing written: the in-memory replicas' snapshot
    (``replicas/``). Tensors are the live ones, not copies. Sync point: all ranks only under a
    sharded engine (its ``state_dict()`` gathers the shards)."""
    from . import rng

    states = single._collective_states(model, optimizer)
    return single._payload(model, optimizer, scheduler, loader, step, epoch, [rng.capture()],
                           extra or {}, states)  # fmt: skip
