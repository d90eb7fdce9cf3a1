"""What the ranks compare so that a mistake on one of them is said, not trained through.

``gather_rows`` is the primitive: one all-gather of a fixed-length row of numbers per rank (a
tensor, never a pickle: a peer can only send numbers). ``agree_batches`` is its first use:
``rt.prepare`` gathers each rank's per-process batch size and data set length, so a job whose
ranks were given different batch sizes logs the batch it really trains on ("global batch 24 =
16 + 8 per process", not rank 0's "32") and says why that is a mistake. The first-batch check
(``first_batch.py``) and the replica check of ``rt.save`` (``saving.py``) use it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ..comm import collectives as comm
from ..runtime import Runtime


def gathers(rt: Runtime) -> bool:
    """Do the ranks compare anything? Only several processes of a launched strategy."""
    return rt.strategy_spec.kind == "processes" and comm.world_size() > 1


def _device(rt: Runtime) -> torch.device:
    """Where the backend takes tensors: the rank's device under NCCL, else the CPU."""
    if rt.backend is None or "nccl" in rt.backend or rt.device.type == "cpu":
        return rt.device
    return torch.device("cpu")


def gather_rows(
    rt: Runtime, row: Sequence[float], *, label: str, dtype: torch.dtype = torch.float64
) -> list[list[float]]:
    """Every rank's ``row`` (same length on every rank), in rank order. Sync point: all ranks."""
    mine = torch.tensor(list(row), dtype=dtype, device=_device(rt))
    return [t.tolist() for t in comm.all_gather_tensors(mine, label=label)]


def data_groups(rt: Runtime) -> list[list[int]]:
    """Ranks that read different shares of the data: all of them, or each of the mesh's data
    groups (tensor peers read the same batch on purpose)."""
    if rt.mesh is None:
        return [list(range(comm.world_size()))]
    return rt.mesh.all_groups("data")


@dataclass(frozen=True)
class Batches:
    """The per-process batch size and data set length (-1: unknown) of every rank."""

    sizes: list[int]
    lengths: list[int]
    group: list[int]
    """The data group of this rank: the ranks whose batches make up one global batch."""

    @property
    def global_batch(self) -> int:
        return sum(self.sizes[r] for r in self.group)

    @property
    def uneven(self) -> bool:
        return len(set(self.sizes)) > 1


def _length(dataset: Any) -> int:
    """A map-style data set's length; -1 for a stream (its ``len``, if any, is a share)."""
    if isinstance(dataset, IterableDataset):
        return -1
    try:
        return len(dataset)
    except TypeError:
        return -1


def agree_batches(rt: Runtime, loader: Any) -> Batches | None:
    """Every rank's per-process batch size and data set length (one small integer all-gather),
    or None in one process. Sync point: all ranks under a multi-process strategy."""
    if not gathers(rt):
        return None
    rows = gather_rows(
        rt, [loader.batch_size, _length(loader.dataset)], label="rt.prepare batch sizes",
        dtype=torch.int64,
    )  # fmt: skip
    group = next(g for g in data_groups(rt) if comm.rank() in g)
    return Batches([int(r[0]) for r in rows], [int(r[1]) for r in rows], group)


def _per_rank(values: list[int]) -> str:
    shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values[:8]))
    return shown + (f", ... ({len(values)} ranks)" if len(values) > 8 else "")


def uneven_line(strategy: str, batches: Batches) -> str:
    """The prepare line when the ranks' batch sizes differ: the true global batch."""
    parts = " + ".join(str(batches.sizes[r]) for r in batches.group[:8])
    more = " + ..." if len(batches.group) > 8 else ""
    return (
        f"rankwise prepare [{strategy}]: the ranks were given different batch sizes "
        f"({_per_rank(batches.sizes)}): global batch {batches.global_batch} = {parts}{more} "
        "per process"
    )


def uneven_warning(batches: Batches, told: int) -> str | None:
    """What rank 0 warns when the ranks disagree on the batch size or the data set."""
    said = []
    if batches.uneven:
        said.append(
            f"the ranks' batch sizes differ ({_per_rank(batches.sizes)}): each optimizer step "
            f"trains on a global batch of {batches.global_batch}, not the {told} that rank 0's "
            "batch size implies, and the gradient average weighs a sample of a smaller batch "
            "more than one of a larger batch"
        )
    known = [n for n in batches.lengths if n >= 0]
    if len(set(known)) > 1:
        said.append(
            f"the ranks' data sets differ in length ({_per_rank(batches.lengths)}): the "
            "sampler splits the indices as if every rank held the same data set, so the ranks "
            "read overlapping or missing samples"
        )
    if not said:
        return None
    return (
        "rt.prepare(): " + "; and ".join(said) + ". Fix: give the DataLoader the same "
        "batch_size and the same data set on every rank (or rt.prepare(..., "
        "global_batch_size=N), which derives the per-process batch from one number)."
    )
