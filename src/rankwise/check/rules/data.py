"""Rules about feeding data: samplers, shuffling, epochs and what batch_size means."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..analysis.astutil import call_args, dotted, keyword, last_name
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import (
    assigned_name,
    ddp_calls,
    dp_calls,
    has_sampler,
    init_calls,
    loader_calls,
    names_in,
    sampler_of,
    set_epoch_in,
)


@rule(
    "RW003",
    "sampler-with-shuffle",
    Severity.ERROR,
    "DataLoader given both a DistributedSampler and shuffle=True",
)
def sampler_with_shuffle(s: Script) -> Iterator[Hit]:
    for loader in loader_calls(s):
        shuffle = call_args(loader, 2, "shuffle")
        if not (isinstance(shuffle, ast.Constant) and shuffle.value):
            continue  # shuffle=(sampler is None) is the correct idiom
        sampler = sampler_of(s, loader)
        if sampler is None:
            continue
        yield (
            keyword(loader, "shuffle") or loader,
            f"This DataLoader gets shuffle={shuffle.value!r} and a DistributedSampler (line "
            f"{sampler.lineno}); torch raises 'ValueError: sampler option is mutually exclusive "
            "with shuffle'. The sampler already shuffles (with its seed and set_epoch).",
            "Drop `shuffle=` from the DataLoader (or write `shuffle=(sampler is None)`); shuffle "
            "in the sampler: `DistributedSampler(dataset, shuffle=True)`.",
        )


def _defines_iterable_dataset(s: Script) -> bool:
    return any(
        isinstance(n, ast.ClassDef) and any(last_name(b) == "IterableDataset" for b in n.bases)
        for n in s.nodes
    )


def _has_backward(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and last_name(n.func) == "backward" for n in ast.walk(node))


def _trains_on(s: Script, name: str) -> bool:
    """Is ``name`` iterated by a loop that calls .backward() (here or in a local function)?"""
    for n in s.nodes:
        loops_over = isinstance(n, ast.For | ast.AsyncFor) and name in names_in(n.iter)
        if loops_over and any(_has_backward(p) for p in (n, *s.local_callees(n))):
            return True
        if isinstance(n, ast.Call) and any(name in names_in(a) for a in n.args):
            f = s.function_called(n)
            if f is not None and _has_backward(f):
                return True
    return False


@rule(
    "RW004",
    "ddp-without-distributed-sampler",
    Severity.WARNING,
    "DDP is used but a training DataLoader has no distributed sampler",
)
def ddp_without_distributed_sampler(s: Script) -> Iterator[Hit]:
    ddps = ddp_calls(s)
    if not ddps or _defines_iterable_dataset(s):
        return
    for loader in loader_calls(s):
        name = assigned_name(s, loader)
        if has_sampler(loader) or name is None or not _trains_on(s, name):
            continue
        yield (
            loader,
            f"The model is wrapped in DDP (line {ddps[0].lineno}) but `{name}` has no "
            "DistributedSampler: every rank trains on the same batches, so each epoch costs "
            "world_size times the work for the gradient of one replica.",
            "Give the DataLoader `sampler=DistributedSampler(dataset)` (and no shuffle=), and "
            "call `sampler.set_epoch(epoch)` each epoch; or use `rw.loader(...)`.",
        )


def _uses(s: Script, name: str) -> list[ast.AST]:
    """Loops over ``name`` and calls that pass ``name`` on (``train(model, loader)``)."""
    out: list[ast.AST] = []
    for n in s.nodes:
        if isinstance(n, ast.For | ast.AsyncFor) and name in names_in(n.iter):
            out.append(n)
        elif isinstance(n, ast.Call) and last_name(n.func) != "set_epoch":
            passed = (*n.args, *(k.value for k in n.keywords))
            out.extend([n] if any(name in names_in(a) for a in passed) else [])
    return out


def _head(loop: ast.AST) -> ast.AST:
    return loop.test if isinstance(loop, ast.While) else loop.iter


def _epoch_loops(s: Script, name: str) -> list[ast.AST]:
    """The loops that go over ``name`` again and again (the epoch loops)."""
    found: list[ast.AST] = []
    frontier = _uses(s, name)
    for _ in range(3):  # follow a use inside a function to that function's call sites
        nxt = []
        for use in frontier:
            outer = [lp for lp in s.ctx[use].loops if name not in names_in(_head(lp))]
            if outer:
                if outer[-1] not in found:
                    found.append(outer[-1])
                continue
            scope = s.scope_of.get(use)
            if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                nxt += [c for c in s.calls if last_name(c.func) == scope.name and c is not use]
        frontier = nxt
    return found


def _bare_samplers(s: Script) -> list[tuple[str, ast.Call]]:
    """``sampler = DistributedSampler(ds)`` (torch's or ``rw.DistributedSampler``) iterated
    by the script itself (``for i in sampler``) or through a wrapper built from it
    (``BatchSampler(sampler, ...)``, a custom loader): (name iterated, sampler)."""
    out = []
    for c in s.calls:
        if not s.is_api(c.func, "DistributedSampler", unresolved=True):
            continue
        if _unshuffled(c):
            continue
        name = assigned_name(s, c)
        names = [name] if name else []
        loaders = loader_calls(s)  # DataLoaders over the sampler: _named_loaders' business
        for other in s.calls:  # one hop: a sampler or loader of the script's that wraps it
            passed = (*other.args, *(k.value for k in other.keywords))
            takes = name and other is not c and any(dotted(a) == name for a in passed)
            wraps = (last_name(other.func) or "").lower().endswith(("sampler", "loader"))
            if takes and wraps and other not in loaders:
                names += [n for n in [assigned_name(s, other)] if n]
        out += [(n, c) for n in names]
    return out


def _iterating_epoch_loops(s: Script, name: str) -> list[ast.AST]:
    """The loops around a ``for ... in name`` of this function: a sampler iterated by hand. A
    sampler passed to a function is not followed (another file may call set_epoch on it)."""
    found: list[ast.AST] = []
    for n in s.nodes:
        if isinstance(n, ast.For | ast.AsyncFor) and name in names_in(n.iter):
            outer = [lp for lp in s.ctx[n].loops if name not in names_in(_head(lp))]
            if outer and outer[-1] not in found:
                found.append(outer[-1])
    return found


@rule(
    "RW005",
    "missing-set-epoch",
    Severity.WARNING,
    "epoch loop over a DistributedSampler without sampler.set_epoch(epoch)",
)
def missing_set_epoch(s: Script) -> Iterator[Hit]:
    seen: set[ast.AST] = set()
    loaders = [(n, smp, _epoch_loops) for n, smp in [*_named_loaders(s), *_stored_loaders(s)]]
    bare = [(n, smp, _iterating_epoch_loops) for n, smp in _bare_samplers(s)]
    for name, sampler, epoch_loops in [*loaders, *bare]:
        for loop in epoch_loops(s, name):
            if set_epoch_in(s, loop) or loop in seen:
                continue
            seen.add(loop)
            yield (
                loop,
                f"This loop goes over `{name}` (DistributedSampler at line {sampler.lineno}) "
                "epoch after epoch without calling set_epoch: the sampler's shuffle is seeded "
                "by seed + epoch, so every epoch repeats the first epoch's order.",
                "Call `sampler.set_epoch(epoch)` (or `loader.sampler.set_epoch(epoch)`) at the "
                "start of each epoch, before iterating the loader.",
            )


def _shuffled_sampler(s: Script, loader: ast.Call) -> ast.Call | None:
    sampler = sampler_of(s, loader)
    if sampler is None:
        return None
    return None if _unshuffled(sampler) else sampler


def _unshuffled(sampler: ast.Call) -> bool:
    """``shuffle=False``: the same order whatever the epoch, so set_epoch changes nothing."""
    shuffle = keyword(sampler, "shuffle")
    return (
        shuffle is not None and isinstance(shuffle.value, ast.Constant) and not shuffle.value.value
    )


def _named_loaders(s: Script) -> list[tuple[str, ast.Call]]:
    """``loader = DataLoader(..., sampler=DistributedSampler(...))``: (name, sampler)."""
    out = []
    for loader in loader_calls(s):
        sampler, name = _shuffled_sampler(s, loader), assigned_name(s, loader)
        if sampler is not None and name is not None:
            out.append((name, sampler))
    return out


def _stored_loaders(s: Script) -> list[tuple[str, ast.Call]]:
    """A loader built in a helper (``return DataLoader(...)``) and kept as ``self.X``, which a
    method iterates: pytorch/examples' ``Trainer(train_data=prepare_dataloader(...))``."""
    built = [
        sampler
        for loader in loader_calls(s)
        if assigned_name(s, loader) is None and (sampler := _shuffled_sampler(s, loader))
    ]
    if not built:
        return []
    iterated = {dotted(n.iter) for n in s.nodes if isinstance(n, ast.For | ast.AsyncFor)}
    return [
        (name, built[0])
        for name, bound in s.bindings.items()
        if name.startswith("self.")
        and name.count(".") == 1
        and name in iterated
        and any(isinstance(b.value, ast.Name | ast.Call) for b in bound)
    ]


COUNT_NAMES = frozenset(
    {
        "n_gpu",
        "ngpu",
        "n_gpus",
        "ngpus",
        "num_gpu",
        "num_gpus",
        "gpu_count",
        "n_devices",
        "ndevices",
        "num_devices",
        "ngpus_per_node",
        "nproc_per_node",
        "nprocs",
        "world_size",
    }
)


def _is_device_count(e: ast.AST) -> bool:
    if isinstance(e, ast.Call):
        name = last_name(e.func)
        if name in ("device_count", "get_world_size"):
            return True
        if name == "len" and e.args:  # len(gpus), len(device_ids)
            text = ast.unparse(e.args[0]).lower()
            return "gpu" in text or "device" in text
        return False
    return (last_name(e) or "").lower() in COUNT_NAMES


def _scaled(s: Script, expr: ast.AST, at: ast.AST, ops: tuple[type, ...]) -> ast.BinOp | None:
    for value in s.values(expr, at):
        for n in ast.walk(value):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ops):
                operands = (
                    (n.right,)
                    if isinstance(n.op, ast.Div | ast.FloorDiv)
                    else (
                        n.left,
                        n.right,
                    )
                )
                if any(_is_device_count(o) for o in operands):
                    return n
    return None


@rule(
    "RW012",
    "dp-batch-size",
    Severity.WARNING,
    "batch_size scaled by the device count the wrong way for DP or DDP",
)
def dp_batch_size(s: Script) -> Iterator[Hit]:
    dp, ddp = bool(dp_calls(s)), bool(ddp_calls(s) or init_calls(s))
    if dp == ddp:
        return  # neither, or both (a script choosing at run time): ambiguous
    ops = (ast.Div, ast.FloorDiv) if dp else (ast.Mult,)
    seen = set()
    for loader in loader_calls(s):
        bs = call_args(loader, 1, "batch_size")
        binop = _scaled(s, bs, loader, ops) if bs is not None else None
        if binop is None or id(binop) in seen:
            continue
        seen.add(id(binop))
        where = binop if hasattr(binop, "lineno") else loader
        if dp:
            msg = (
                f"`{s.snippet(binop)}` divides the DataLoader's batch_size (line {loader.lineno}) "
                "by the device count, but with DataParallel batch_size is the total: DP splits "
                "each batch across the devices again, so each device gets batch/N²."
            )
            fix = "With DataParallel pass the global batch size (per-device size × devices)."
        else:
            msg = (
                f"`{s.snippet(binop)}` multiplies the DataLoader's batch_size (line "
                f"{loader.lineno}) by the device count, but with DDP batch_size is per process: "
                "each process loads N times the batch and the global batch becomes batch × N²."
            )
            fix = (
                "With DDP pass the per-process batch size (global // world_size), or use "
                "`rw.loader(dataset, global_batch_size=...)`."
            )
        yield where, msg, fix
