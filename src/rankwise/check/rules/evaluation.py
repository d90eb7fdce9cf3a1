"""Rules about results that depend on how the data was split: padded evaluation, BatchNorm.

A distributed sampler pads the data set to a multiple of the number of processes so that every
rank runs as many steps: right for training, wrong for evaluation, where the padded samples are
counted twice (101 samples on 2 ranks count as 102). And BatchNorm normalises over each rank's
own batch: with a few samples per process its statistics are noise, and the model ends far from
the one-process run on the same global batch.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..analysis.astutil import call_args, keyword, last_name
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import assigned_name, ddp_calls, is_distributed_script, loader_calls, names_in
from .ranks import runtimes

SMALL_BATCH = 16
"""A per-process batch of at most this many samples is small for BatchNorm's statistics."""
COUNTS = frozenset({"append", "extend", "all_gather", "gather", "item", "sum", "update"})


def _trains(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and last_name(n.func) == "backward" for n in ast.walk(node))


def _counts(loop: ast.AST) -> bool:
    """Does the loop accumulate something per sample (``correct += ...``, ``.append``)?"""
    for n in ast.walk(loop):
        if isinstance(n, ast.AugAssign):
            return True
        if isinstance(n, ast.Call) and last_name(n.func) in COUNTS:
            return True
    return False


def _true(call: ast.Call, name: str) -> bool:
    kw = keyword(call, name)
    return kw is not None and not (isinstance(kw.value, ast.Constant) and not kw.value.value)


def _padding_loaders(s: Script) -> list[tuple[str, ast.Call]]:
    """Loaders whose sampler pads: ``rt.prepare_loader(x)`` without ``evaluation=True``,
    ``rw.loader(...)`` without it, or a DataLoader over torch's ``DistributedSampler`` without
    ``drop_last``; as (name bound, the call)."""
    rts = runtimes(s)
    out = []
    for c in s.calls:
        f = c.func
        prepared = isinstance(f, ast.Attribute) and f.attr == "prepare_loader"
        prepared = prepared and ast.unparse(f.value) in rts
        built = s.is_rankwise(f) and last_name(f) == "loader"
        if (prepared or built) and not _true(c, "evaluation"):
            name = assigned_name(s, c)
            out += [(name, c)] if name else []
    for loader in loader_calls(s):
        sampler = call_args(loader, 3, "sampler")
        found = s.may_be_call_to(sampler, "DistributedSampler", at=loader) if sampler else None
        if found is not None and not _true(found, "drop_last"):
            name = assigned_name(s, loader)
            out += [(name, loader)] if name else []
    return out


@rule(
    "RW023",
    "evaluation-loader-pads",
    Severity.WARNING,
    "an evaluation loop counts over a distributed loader that pads with duplicate samples",
)
def evaluation_loader_pads(s: Script) -> Iterator[Hit]:
    if not is_distributed_script(s):
        return
    for name, call in _padding_loaders(s):
        for loop in s.nodes:
            if not isinstance(loop, ast.For | ast.AsyncFor) or name not in names_in(loop.iter):
                continue
            if _trains(loop) or not _counts(loop):
                continue
            yield (
                loop,
                f"This loop evaluates over `{name}` (line {call.lineno}), whose distributed "
                "sampler pads the data set to a multiple of the number of processes: when the "
                "length does not divide, the repeated samples are counted twice (101 samples "
                "on 2 processes count as 102).",
                f"Build it for evaluation: `{name} = rt.prepare_loader(loader, evaluation=True)` "
                "(or `rw.loader(dataset, ..., evaluation=True)`), each sample seen once, and "
                "collect per-sample results with `rw.gather_for_metrics`.",
            )
            break


def _batchnorms(s: Script) -> list[ast.AST]:
    return [
        n
        for n in s.nodes
        if isinstance(n, ast.Attribute | ast.Name)
        and (last_name(n) or "").startswith("BatchNorm")
        and (last_name(n) or "")[-2:] in ("1d", "2d", "3d")
    ]


def _syncs(s: Script) -> bool:
    return any(
        "SyncBatchNorm" in (last_name(n) or "") or last_name(n) == "convert_sync_batchnorm"
        for n in s.nodes
        if isinstance(n, ast.Attribute | ast.Name)
    )


def _small_batch(s: Script) -> tuple[int, ast.Call] | None:
    """The smallest literal per-process batch size of a loader, when at most SMALL_BATCH."""
    found = []
    for c in s.calls:
        is_loader = s.is_api(c.func, "DataLoader", unresolved=True) or (
            s.is_rankwise(c.func) and last_name(c.func) == "loader"
        )
        bs = call_args(c, 1, "batch_size") if is_loader else None
        for value in s.values(bs, c) if bs is not None else []:
            if isinstance(value, ast.Constant) and isinstance(value.value, int):
                found.append((value.value, c))
    small = [f for f in found if 0 < f[0] <= SMALL_BATCH]
    return min(small, key=lambda f: f[0]) if small else None


@rule(
    "RW024",
    "batchnorm-small-batch",
    Severity.WARNING,
    "BatchNorm over a small per-process batch under several processes, without SyncBatchNorm",
)
def batchnorm_small_batch(s: Script) -> Iterator[Hit]:
    several = ddp_calls(s) or any(
        isinstance(c.func, ast.Attribute) and c.func.attr == "prepare" for c in s.calls
    )
    if not several or not is_distributed_script(s) or _syncs(s):
        return
    bns, small = _batchnorms(s), _small_batch(s)
    if not bns or small is None:
        return
    size, loader = small
    yield (
        bns[0],
        f"`{s.snippet(bns[0])}` normalises over each process's own batch, and the loader at "
        f"line {loader.lineno} gives each process {size} samples: the batch statistics come "
        "from those few samples only, so the model trains differently from one process on the "
        "global batch (and a batch of 1 fails in training mode).",
        "Convert the model before preparing it, `model = rw.convert_sync_batchnorm(model)` "
        "(torch's `nn.SyncBatchNorm.convert_sync_batchnorm` on CUDA), so the statistics cover "
        "the global batch; or use a larger per-process batch, or GroupNorm/LayerNorm.",
    )
