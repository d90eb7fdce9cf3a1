"""``gather_for_metrics``: every rank's evaluation outputs, once each, in dataset order.

Averaging per-rank metrics is wrong twice over: ranks hold different numbers of samples, and a
padding sampler evaluates some samples twice. The exact way is to evaluate with
``rw.loader(..., evaluation=True)`` (no padding, each sample once), keep this rank's outputs,
and gather them once at the end. ``DistributedSampler`` strides the data (rank ``r`` holds
positions ``r, r + world, r + 2 * world, ...``), so the gathered rows are interleaved back into
the sampler's order: dataset order when it does not shuffle. Under ``rw.init(mesh=...)`` the
gather runs over this rank's data group: its tensor and pipeline peers hold the same batches,
and each sample must appear once, not once per peer. Descriptions and lists
travel as JSON, never pickled: a peer cannot run code here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .. import runtime, validate
from ..comm import collectives as comm
from ..comm import wire
from ..errors import ConfigError, DistributedError
from . import _coords
from .sampler import share_size

T = TypeVar("T")


def gather_for_metrics(data: T, *, num_samples: int | None = None) -> T:
    """Gather this rank's per-sample outputs from every rank, interleaved into sampler order.

    ``data`` is a tensor (samples along dim 0), a list of per-sample Python objects, or a
    tuple/dict nesting those (e.g. ``(predictions, targets)``); the result has the same shape
    on every rank. With an evaluation loader the result holds exactly the dataset's samples.
    After a padding sampler, pass ``num_samples=len(dataset)`` to drop the padded duplicates
    (they are always the last positions). Sync point: all ranks (call it once, after the loop).
    """
    validate.integer("num_samples", num_samples, minimum=0, optional=True,
                     where="rw.gather_for_metrics()")  # fmt: skip
    world = _coords.require_group("gather_for_metrics")
    group = runtime.data_group()  # None: every rank reads its own data
    peers = None if group is None else dist.get_process_group_ranks(group)
    world = world if peers is None else len(peers)
    leaves, rebuild = _flatten(data)
    counts = [_count(leaf) for leaf in leaves]
    if len(set(counts)) > 1:
        raise ConfigError(
            f"gather_for_metrics got parts with different numbers of samples: {counts}",
            fix="pass per-sample outputs only, e.g. (predictions, targets) with equal lengths.",
        )
    if world == 1:
        gathered = leaves
        total = counts[0] if counts else 0
    else:
        everyone = wire.all_gather_json([_describe(leaf) for leaf in leaves], label="metrics", group=group)
        per_rank = _check_agreement(everyone)
        total = sum(per_rank)
        gathered = [
            _gather_leaf(leaf, per_rank, [meta[i] for meta in everyone], world, group)
            for i, leaf in enumerate(leaves)
        ]
    if num_samples is not None:
        gathered = [_truncate(leaf, num_samples, total) for leaf in gathered]
    return rebuild(gathered)


def _flatten(data: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    if isinstance(data, (torch.Tensor, list)):
        return [data], lambda out: out[0]
    if isinstance(data, (tuple, dict)):
        keys = list(data.keys()) if isinstance(data, dict) else list(range(len(data)))
        parts = [_flatten(data[k]) for k in keys]
        sizes = [len(leaves) for leaves, _ in parts]

        def rebuild(out: list[Any]) -> Any:
            items, at = [], 0
            for (_, sub), size in zip(parts, sizes, strict=True):
                items.append(sub(out[at : at + size]))
                at += size
            if isinstance(data, dict):
                return dict(zip(keys, items, strict=True))
            return type(data)(*items) if hasattr(data, "_fields") else tuple(items)

        return [leaf for leaves, _ in parts for leaf in leaves], rebuild
    raise ConfigError(
        f"gather_for_metrics cannot gather a {type(data).__name__}",
        fix="pass tensors (samples along dim 0), lists of per-sample values, or tuples/dicts of "
        "those.",
    )


def _count(leaf: Any) -> int:
    return len(leaf) if isinstance(leaf, list) else (leaf.shape[0] if leaf.dim() else 1)


def _describe(leaf: Any) -> list:
    """[kind, samples, trailing shape, dtype name]: JSON, as it travels between ranks."""
    if isinstance(leaf, list):
        return ["list", len(leaf), None, None]
    return ["tensor", _count(leaf), list(leaf.shape[1:]), str(leaf.dtype).removeprefix("torch.")]


def _well_formed(m: Any) -> bool:
    return isinstance(m, list) and all(
        isinstance(d, list) and len(d) == 4 and isinstance(d[1], int) and d[1] >= 0 for d in m
    )


def _check_agreement(everyone: list[Any]) -> list[int]:
    """Per-rank sample counts, after checking every rank passed the same kind of data."""
    for r, m in enumerate(everyone):
        if not _well_formed(m) or len(m) != len(everyone[0]):
            raise DistributedError(
                f"rank {r} described its gather_for_metrics data as {str(m)[:120]!r}, not as "
                "every other rank did",
                fix="every rank must call gather_for_metrics with the same structure and run "
                "the same rankwise version.",
                rank=comm.rank(),
            )
    shapes = [[(kind, trailing, dtype) for kind, _, trailing, dtype in m] for m in everyone]
    # A rank with no samples may describe an empty tensor loosely (e.g. shape (0,)).
    filled = [s for s, m in zip(shapes, everyone, strict=True) if all(d[1] for d in m)]
    if filled and any(s != filled[0] for s in filled):
        raise DistributedError(
            f"ranks passed different data to gather_for_metrics: {shapes}",
            fix="every rank must pass the same structure, trailing shapes and dtypes.",
            rank=comm.rank(),
        )
    per_rank = [m[0][1] if m else 0 for m in everyone]
    world, total = len(per_rank), sum(per_rank)
    expected = [share_size(total, world, r) for r in range(world)]
    if per_rank != expected:
        raise DistributedError(
            f"per-rank sample counts {per_rank} are not the strided split {expected} of {total} "
            "samples that DistributedSampler produces, so dataset order cannot be restored",
            fix="evaluate with rw.loader(dataset, batch_size=..., evaluation=True) and pass "
            "every output of this rank, once, after the loop.",
            rank=comm.rank(),
        )
    return per_rank


def _gather_leaf(
    leaf: Any, per_rank: list[int], metas: list[tuple], world: int, group: Any
) -> Any:
    most = max(per_rank)
    if isinstance(leaf, list):
        parts = wire.all_gather_json(_json_list(leaf), label="gather_for_metrics", group=group)
        for r, part in enumerate(parts):
            if not isinstance(part, list) or len(part) != per_rank[r]:
                raise DistributedError(
                    f"rank {r} sent {str(part)[:80]!r} where {per_rank[r]} samples were announced",
                    fix="every rank must run the same rankwise version.",
                    rank=comm.rank(),
                )
        return [parts[r][j] for j in range(most) for r in range(world) if j < per_rank[r]]
    trailing, name = next((m[2], m[3]) for m in metas if m[1] == most)
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise DistributedError(
            f"a rank described its gather_for_metrics dtype as {str(name)[:40]!r}",
            fix="every rank must run the same rankwise version.",
            rank=comm.rank(),
        )
    device = comm._comm_device()
    mine = leaf.detach().reshape(-1, *trailing).to(device=device, dtype=dtype)
    padded = torch.zeros((most, *trailing), dtype=dtype, device=device)
    padded[: mine.shape[0]] = mine
    slots = comm.all_gather_tensors(padded, group=group, label="gather_for_metrics")
    # [world, most, ...] -> [most, world, ...]: row j*world + r is rank r's j-th sample; the
    # strided split leaves the missing rows (j >= per_rank[r]) at the very end.
    rows = torch.stack(slots, dim=1).reshape(most * world, *trailing)
    return rows[: sum(per_rank)].to(leaf.device)


def _json_list(leaf: list) -> list:
    """The list, checked to travel as JSON: rankwise never unpickles what other ranks send."""
    try:
        wire.encode_json(leaf)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"gather_for_metrics sends lists between ranks as JSON, and this one cannot be: {exc}",
            fix="pass tensors, or lists of str/int/float/bool/None (tuples arrive as lists); for "
            "other objects use rw.all_gather_object, which unpickles and so trusts every rank.",
        ) from None
    return leaf


def _truncate(leaf: Any, num_samples: int, total: int) -> Any:
    if not 0 <= num_samples <= total:
        raise ConfigError(
            f"num_samples={num_samples} but only {total} samples were gathered",
            fix="pass num_samples=len(dataset); if the sampler dropped samples (drop_last=True), "
            "evaluate with rw.loader(..., evaluation=True) instead.",
        )
    return leaf[:num_samples]
