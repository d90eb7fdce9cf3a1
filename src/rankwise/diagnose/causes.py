"""Why the ranks disagree, recognised from their records, and the fix that goes with each cause.

A collective that hangs or disagrees is a symptom; the fix depends on the cause, and the
common causes leave recognisable traces:

- a rank **raised** an exception: it announced it (``rankwise/diag/raised``); the others only
  failed waiting for it, and its traceback is the cause;
- **uneven data**: a rank ran out of batches and left its training loop, so its last
  collective was a training step's (a gradient bucket, a ZeRO unit's gradients) while another
  rank is in the next step's; the fix is a loader that gives every rank as many batches
  (``rw.loader``, ``rt.prepare``) or ``join()``;
- **per-rank batch sizes**: the same collective with tensors that differ only in their first
  dimension (a batch of another size on each rank), fixed by the same prepared loader;
- **a sharded model or optimizer used on some ranks only**: under ZeRO a forward, a backward,
  ``state_dict()`` or ``opt.state_dict()`` is itself a collective (it gathers the units' shards),
  so ``if rank == 0: model(x)`` waits for ranks that never come; the record's call site sits
  inside a rank guard, which uneven data never does; the fix is every rank calling it
  (``rt.full_parameters``, ``rt.save``), not padding the data;
- otherwise a collective issued on some ranks only, or in another order (``if rank == 0:``).

Pure functions over records (no torch.distributed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from .records import RankView, Record, Site, if_context


class Cause(NamedTuple):
    """What a diagnosis found: ``tag`` ('raised', 'uneven', 'batch', 'mismatch', 'dead',
    'finished', 'behind' or 'unknown'), the sentence that says so, the fix, and the ranks the
    sentence names (the launcher's headline)."""

    tag: str
    sentence: str
    fix: str
    ranks: list[int]


FIX_MISMATCH = (
    "every rank must issue the same collectives, in the same order, with the same shapes and "
    "dtypes; look at the call sites above for a collective inside a rank-dependent branch "
    "(`if rank == 0:`) or a tensor whose shape depends on the rank's data."
)
FIX_DEAD = (
    "read the log of the rank that stopped: its first error is the cause (a rank killed by the "
    "OS, e.g. out of memory, leaves no Python traceback; `dmesg` shows it)."
)
FIX_FINISHED = (
    "every rank must call each collective: this one ran on some ranks only (look at its call "
    "site above: a collective under `if rank == 0:`), and the others ended their script without "
    "it. Call it on every rank and use its result on rank 0 only, or drop it."
)
FIX_BEHIND = (
    "every rank must reach the same collectives; the rank(s) named above are busy elsewhere "
    "(a collective skipped under a condition, an endless loop, or a much slower step). "
    "If the work is just slow, raise the timeout: rw.init(timeout=...)."
)
FIX_UNEVEN = (
    "every rank must run the same number of training steps: give each rank as many batches "
    "(rw.loader(dataset, global_batch_size=...) or rt.prepare(model, opt, loader), whose "
    "sampler pads or drops so that every rank gets the same count, or torch's "
    "DistributedSampler), or, for data that is uneven by nature, wrap the loop in "
    "`with model.join():` (DDP) or iterate over `rw.join(batches)`; docs/ddp.md."
)
FIX_BATCH = (
    "every rank must use batches of the same size: rw.loader(dataset, global_batch_size=...) "
    "or rt.prepare(model, opt, loader) splits the global batch evenly (drop_last=True drops a "
    "short last batch); to collect per-sample results whose count differs between ranks, use "
    "rw.gather_for_metrics, which pads them."
)

_STEP_LABELS = re.compile(
    r"^(gradient bucket \d+|gradients of unit \d+|parameters of unit \d+|used-parameter map"
    r"|join: sync flag|[\w ]+: gradients, step \d+)$"
)


def is_step(rec: Record | None) -> bool:
    """A collective that a training step issues (DDP's buckets, ZeRO's units, ``rw.updates``)."""
    return rec is not None and rec.label is not None and bool(_STEP_LABELS.match(rec.label))


def fix_raised(ranks: list[int]) -> str:
    first = ranks[0]
    return (
        f"read rank {first}'s traceback and fix that error (under rankwise run its lines start "
        f"with [rank{first}]:); the other ranks failed only because rank "
        f"{', '.join(map(str, ranks))} left the job."
    )


def raised_sentence(views: Iterable[RankView]) -> tuple[str, list[int]] | None:
    """'Rank 0's exception is the cause: the other ranks only waited for it.'"""
    ranks = [v.rank for v in views if v.raised]
    if not ranks:
        return None
    whose = f"Rank {ranks[0]}'s exception is" if len(ranks) == 1 else (
        f"The exceptions of ranks {', '.join(map(str, ranks))} are")  # fmt: skip
    return f"{whose} the cause: the other ranks only waited for it.", ranks


def uneven_sentence(want: Record, views: list[RankView]) -> tuple[str, list[int]] | None:
    """Ranks that left the training loop while others are in a training step's collective."""
    stepping = [v.rank for v in views if is_step(v.latest) and v.latest.seq >= want.seq
                and not v.finished]  # fmt: skip
    if not stepping:
        return None
    left = []
    for v in views:
        rec = v.latest
        if v.rank in stepping or v.raised or rec is None:
            continue
        # Finished after a step's collective (the loop ended), or at the same number in a
        # collective that is not a step's (past the loop): either way it left training.
        if (v.finished and is_step(rec)) or (rec.seq == want.seq and not is_step(rec)):
            left.append(v.rank)
    if not left:
        return None
    who, still = ", ".join(map(str, left)), ", ".join(map(str, stepping))
    return (
        f"Uneven data: rank(s) {who} stopped training (their batches ran out, or they left the "
        f"loop) while rank(s) {still} are still training (in a training step's {want.op} "
        f"#{want.seq}).",
        left,
    )


_TENSOR = re.compile(r"(\w+)\[([\d,]*)\]")


def _tensors(sig: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _TENSOR.findall(sig)]


def batch_sentence(records: dict[int, Record]) -> str | None:
    """The same collective whose tensors differ only in their first dimension on some ranks."""
    recs = sorted(records.items())
    if len(recs) < 2 or len({(r.op, r.label) for _, r in recs}) > 1:
        return None
    shapes = {rank: _tensors(r.sig) for rank, r in recs}
    first = next(iter(shapes.values()))
    if not first or any(len(s) != len(first) for s in shapes.values()):
        return None
    differing: dict[int, int] | None = None
    for i, (dtype, shape) in enumerate(first):
        column = [s[i] for s in shapes.values()]
        if any(d != dtype or len(sh) != len(shape) or not shape or sh[1:] != shape[1:]
               for d, sh in column):  # fmt: skip
            return None
        if differing is None and len({sh[0] for _, sh in column}) > 1:
            differing = {rank: s[i][1][0] for rank, s in shapes.items()}
    if differing is None:
        return None
    sizes = ", ".join(f"{n} on rank {rank}" for rank, n in sorted(differing.items()))
    return (
        f"Per-rank batch sizes: the tensors differ only in their first dimension ({sizes}): "
        "each rank's batch has another size."
    )


_RANK_GUARD = re.compile(r"\b(rank|local_rank|is_master|is_main\w*|is_rank_zero|global_rank)\b")
_UNIT = re.compile(r"^(?:updated )?parameters of (?:unit \d+|every unit \(shared memory\))$")
_OPT_STATE = re.compile(r"^optimizer state of unit \d+$")
_GRADS = re.compile(r"^gradients of unit \d+$")

FIX_SHARDED_FORWARD = (
    "under ZeRO-3 the model's forward (and its state_dict()) is a collective: every rank must "
    "call it. Evaluate on every rank (each on its share of the data, rt.prepare_loader(loader, "
    "evaluation=True)) and print on rank 0 with rt.print; for work on rank 0 alone, enter "
    "`with rt.full_parameters(model) as bare:` on every rank and call bare(x) inside "
    "`if rt.rank == 0:`; to save, call rt.save(path, model=model, optimizer=opt) on every rank "
    "(rank 0 writes). Padding the data or join() does not help here."
)
FIX_SHARDED_STATE = (
    "under ZeRO (zero1, zero2, zero3) the optimizer's state_dict() gathers every rank's shard: "
    "every rank must call it. Call rt.save(path, model=model, optimizer=opt) on every rank "
    "(rank 0 writes, the others take part), or call opt.state_dict() on every rank and only "
    "torch.save it under `if rt.rank == 0:`."
)
FIX_GUARDED = (
    "every rank must call each collective: this one runs inside a rank guard (named above). "
    "Call it on every rank and use its result on rank 0 only (`if rt.rank == 0:` around the "
    "print or the write, not around the collective); rt.save and rw.save_checkpoint are "
    "called on every rank."
)


def _guard(rec: Record) -> str | None:
    """ "inside `if rt.rank == 0`" when ``rec``'s call site sits in a rank-dependent branch."""
    return None if rec.site is None else _guard_at(rec.site)


def _guard_at(site: Site) -> str | None:
    where = if_context(site.file, site.line)
    return where if where and _RANK_GUARD.search(where) else None


FIX_GUARDED_ELSEWHERE = (
    "every rank must call each collective: the rank(s) named above run code that the others "
    "skip (the rank guard above). If that code issues a collective (a barrier, rt.save, a "
    "metric's all-reduce; under ZeRO a forward or a state_dict() of the model or optimizer), "
    "call it on every rank and keep only the rank-0 work (print, write) under the guard: "
    "rt.save(path, model=model, optimizer=opt) on every rank; under zero3 enter "
    "`with rt.full_parameters(model) as bare:` on every rank. If it is only slow work, raise "
    "the timeout: rw.init(timeout=...)."
)


def guarded_elsewhere(views: list[RankView], behind: list[int]) -> tuple[str, str] | None:
    """Seen from a waiting rank: a rank that never reached the collective and is running code
    under a rank guard (its heartbeat's frame): maybe a collective the others skip (under ZeRO a
    unit's all-gather, on another group), maybe only slow work. A sentence and a fix saying both."""
    for v in views:
        where = _guard_at(v.frame) if v.rank in behind and v.frame is not None else None
        if where:
            return (
                f"Rank {v.rank} is running code {where} ({v.frame.short()}) that the other "
                "ranks skip: a collective there would wait for ranks that never come, and "
                "slow work there keeps them waiting here.",
                FIX_GUARDED_ELSEWHERE,
            )
    return None


GUARDED_SHARDED_S = 10.0
"""A ZeRO collective issued under a rank guard is reported after this long (or the configured
stall delay, when shorter): it has no balanced twin on the other ranks to wait for."""


def sharded_under_guard(rec: Record) -> bool:
    """A ZeRO unit's gather or the sharded optimizer's state, issued inside ``if rank == 0:``."""
    label = rec.label or ""
    sharded = _UNIT.match(label) or _GRADS.match(label) or _OPT_STATE.match(label)
    return bool(sharded) and _guard(rec) is not None


def guarded_cause(views: Iterable[RankView]) -> Cause | None:
    """A rank waiting in a collective issued from inside ``if rank == 0:`` (its own call site,
    read from its own file): the collective runs on some ranks only. Under ZeRO the
    collective is the sharded model's forward or the optimizer's state dict, named as such."""
    views = list(views)
    for v in views:
        rec = v.latest
        if rec is None or v.finished or v.raised or rec.state == "done":
            continue
        where = _guard(rec)
        if where is None:
            continue
        at = f"{rec.op} #{rec.seq} from {rec.site.short()}, {where}"
        label = rec.label or ""
        if _UNIT.match(label) or _GRADS.match(label):
            what = "a forward (or backward, state_dict() or full_parameters()) of the ZeRO-3 model"
            return Cause(
                "mismatch",
                f"Rank {v.rank} runs {what} on some ranks only ({at}): "
                "under ZeRO-3 it gathers each unit's parameters from every rank (where the "
                "ranks of a machine share them in memory, it waits for every rank), and "
                "the other ranks never call it.",
                FIX_SHARDED_FORWARD,
                [v.rank],
            )
        if _OPT_STATE.match(label):
            return Cause(
                "mismatch",
                f"Rank {v.rank} calls the sharded optimizer's state_dict() "
                f"on some ranks only ({at}): under ZeRO it gathers every rank's shard "
                "of the optimizer state, and the other ranks never call it.",
                FIX_SHARDED_STATE,
                [v.rank],
            )
        return Cause(
            "mismatch",
            f"Rank {v.rank} issued {at}: a collective on some ranks only.",
            FIX_GUARDED,
            [v.rank],
        )
    return None
