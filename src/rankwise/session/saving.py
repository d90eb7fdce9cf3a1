"""What ``rt.save`` checks before anything is written.

- **Replicas that drifted apart** (``refuse_drifted``). Under data parallelism every replica
  holds the same parameters; a model built or stepped outside ``rt.prepare`` (an optimizer over
  another model, steps taken before prepare, a parameter changed on one rank) trains on copies
  that drift apart, and a checkpoint of rank 0's copy silently drops the others' work.
  ``rt.save`` is a sync point already, so it gathers a fingerprint of each rank's parameters
  (their count and three float64 sums) and refuses, on every rank, when ranks that should hold
  the same parameters do not. Shard-aware: under a mesh only data peers are compared (tensor
  slices and pipeline stages differ on purpose); a zero3 model holds nothing whole, so nothing
  is compared; nor are replicas an asynchronous or local-SGD update rule lets differ
  (``rw.updates``).
- **A checkpoint folder reused without resuming** (``warn_reused_folder``). A second run
  saving into ``ckpt/`` without ``rt.load`` continues the first run's step numbers, overwrites
  its steps or points ``latest`` below them; rank 0 warns once per folder and run.

``before_save`` is the one call ``Session.save`` makes; ``remember_loaded`` the one
``Session.load`` makes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import validate
from ..checkpoint import files
from ..checkpoint.state_dict import registered_inner, unwrap_model
from ..comm import collectives as comm
from ..errors import DistributedError
from ..parallel import ShardedDataParallel
from ..updates.base import replicas_apart
from .agree import gather_rows
from .guards import warn_at_user

RTOL = 1e-9
"""Relative tolerance of the sums: far above float64 rounding of equal tensors summed in
another order, far below what one optimizer step changes."""


@dataclass
class SaveRecord:
    """The checkpoint folders this run has loaded from or saved into (resolved paths)."""

    loaded: set[str] = field(default_factory=set)
    saved: set[str] = field(default_factory=set)


def _key(path: str | os.PathLike) -> str:
    return os.path.realpath(os.fspath(path))


def remember_loaded(record: SaveRecord, path: str | os.PathLike) -> None:
    """``rt.load(path)``: its folder (the folder itself, or the file's) counts as resumed."""
    p = Path(path)
    record.loaded.add(_key(p))
    if not p.is_dir():
        record.loaded.add(_key(p.parent))


def before_save(rt: Any, path: str | os.PathLike, kwargs: dict[str, Any]) -> None:
    """Refuse drifted replicas, then warn about a reused folder. Sync point: all ranks."""
    validate.path("path", path, where="rt.save()")  # before the folder is looked at
    refuse_drifted(rt, kwargs.get("model"))
    warn_reused_folder(rt.saves, path, kwargs.get("step"))


# -- replicas ---------------------------------------------------------------------------------


def _zero3(model: nn.Module) -> bool:
    """Is ``model`` (or a wrapper inside it) a stage-3 engine: parameters sharded?"""
    while isinstance(model, nn.Module):
        if isinstance(model, ShardedDataParallel) and model.stage == 3:
            return True
        inner = model._modules.get("_orig_mod") or model._modules.get("module")
        model = None if inner is model else inner
    return False


def _role(rt: Any, model: nn.Module) -> float:
    """Ranks with the same role must hold the same parameters; -1: compare with nobody."""
    if _zero3(model):
        return -1.0
    if rt.mesh is not None:
        coords = rt.mesh.coords()
        return float(coords["pipeline"] * rt.mesh.sizes["tensor"] + coords["tensor"])
    return float(getattr(model, "stage_index", 0))  # a pipeline's stage: its peers hold it


def _stats(model: nn.Module) -> list[float]:
    """[count, sum, sum of |x|, sum of x²] over the floating parameters, in float64 (one
    transfer per device)."""
    count, by_device = 0, {}
    for p in unwrap_model(model).parameters():
        if not p.is_floating_point() or p.is_meta:
            continue
        x = p.detach()
        count += x.numel()
        by_device.setdefault(x.device, []).append(torch.stack([
            torch.sum(x, dtype=torch.float64),
            torch.sum(x.abs(), dtype=torch.float64),
            torch.sum(x.square(), dtype=torch.float64),
        ]))  # fmt: skip
    total = torch.zeros(3, dtype=torch.float64)
    for parts in by_device.values():
        total += torch.stack(parts).sum(0).cpu()
    return [float(count), *total.tolist()]


def _differ(a: list[float], b: list[float]) -> bool:
    if a[1] != b[1]:  # another number of parameters: another model
        return True
    scales = (max(a[3], b[3]), max(a[3], b[3]), max(a[4], b[4]))
    for x, y, scale in zip(a[2:], b[2:], scales, strict=True):
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return True
        elif abs(x - y) > RTOL * scale:
            return True
    return False


def _drifted(rows: list[list[float]]) -> list[tuple[int, int]]:
    """(reference rank, rank) for every rank whose parameters differ from the first rank of
    its role's."""
    first: dict[float, int] = {}
    out = []
    for r, row in enumerate(rows):
        if row[0] < 0:
            continue
        ref = first.setdefault(row[0], r)
        if ref != r and _differ(rows[ref], row):
            out.append((ref, r))
    return out


def refuse_drifted(rt: Any, model: Any) -> None:
    """Raise on every rank when replicas that should be equal differ. Sync point: all ranks
    of a multi-process job (one small all-gather)."""
    if not isinstance(model, nn.Module) or comm.world_size() < 2:
        return
    apart = replicas_apart(registered_inner(model)) or replicas_apart(model)
    role = -1.0 if apart else _role(rt, model)
    row = [role, *(_stats(model) if role >= 0 else [0.0] * 4)]
    rows = gather_rows(rt, row, label="rt.save: replica fingerprints")
    drifted = _drifted(rows)
    if drifted:
        raise _drift_error(rows, drifted, comm.rank())


def _drift_error(rows: list[list[float]], drifted: list[tuple[int, int]], rank: int) -> Exception:
    ranks = sorted({r for pair in drifted for r in pair})
    sums = ", ".join(f"rank {r}: {rows[r][2]:.6g}" for r in ranks[:8])
    return DistributedError(
        f"rt.save() refused: the model's parameters differ across ranks that should hold the "
        f"same replica (sum of the parameters {sums}{' ...' if len(ranks) > 8 else ''}); "
        "the copies drifted apart, so a checkpoint of rank 0's would silently drop the other "
        "ranks' training. This happens when the model trained is not the one rt.prepare "
        "returned: built outside it (an optimizer over another model), stepped before it, or "
        "changed on some ranks only. Nothing was written",
        fix="build the model once, give it and its optimizer to rt.prepare, and train and save "
        "what it returns: model, opt, loader = rt.prepare(model, opt, loader); ...; "
        "rt.save(path, model=model, optimizer=opt). (rw.save_checkpoint writes rank 0's copy "
        "without this check.)",
        rank=rank,
    )


# -- the checkpoint folder -------------------------------------------------------------------


def warn_reused_folder(record: SaveRecord, path: str | os.PathLike, step: int | None) -> None:
    """The first save of this run into a folder that holds a step at or above this one (any
    step, when ``step`` is None) and that this run did not load: rank 0 warns. No sync point."""
    target = Path(path)
    if not files.is_dir_target(target) or not (step is None or type(step) is int):
        return  # a file, or a step that save_checkpoint refuses with its own message
    key = _key(target)
    first = key not in record.saved and key not in record.loaded
    record.saved.add(key)
    if not first or comm.rank() != 0:
        return
    found = {files.step_of(p): p.name for p in files.list_checkpoints(target)}
    if not found or (step is not None and step > max(found)):
        return
    highest = max(found)
    if step is None:
        what = f"this save continues its numbering as step {highest + 1}"
    elif step == highest:
        what = f"this save of step {step} overwrites it"
    else:
        what = f"this save of step {step} makes 'latest' point below it"
    warn_at_user(
        f"rt.save(): {os.fspath(path)!r} already holds a checkpoint at step {highest} "
        f"({found[highest]}) that this run did not load: {what}, although this run did "
        f"not resume from it. Fix: resume with rt.load({os.fspath(path)!r}, model=model, "
        "optimizer=opt, ...) before training, or give this run a new folder."
    )
