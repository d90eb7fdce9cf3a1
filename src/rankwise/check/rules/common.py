"""Recognisers shared by several rules: wrappers, loaders, samplers, moves to a device."""

from __future__ import annotations

import ast

from ..analysis.astutil import call_args, dotted, last_name
from ..script import Script

DTYPES = frozenset(
    {"float16", "half", "bfloat16", "float32", "float", "float64", "double", "int8", "int64"}
)


def is_ddp(s: Script, func: ast.AST) -> bool:
    """torch's or rankwise's DistributedDataParallel under any alias (``DDP`` included)."""
    if s.is_api(func, "DistributedDataParallel", unresolved=True):
        return True
    bare = isinstance(func, ast.Name) and func.id == "DDP"  # used but never imported (snippets)
    return bare and "DDP" not in s.local_names and "DDP" not in s.aliases


def ddp_calls(s: Script) -> list[ast.Call]:
    return [c for c in s.calls if is_ddp(s, c.func)]


def dp_calls(s: Script) -> list[ast.Call]:
    return [c for c in s.calls if s.is_api(c.func, "DataParallel", unresolved=True)]


def loader_calls(s: Script) -> list[ast.Call]:
    return [c for c in s.calls if s.is_api(c.func, "DataLoader", unresolved=True)]


def init_calls(s: Script) -> list[ast.Call]:
    return [c for c in s.calls if s.is_api(c.func, "init_process_group", unresolved=True)]


def is_distributed_script(s: Script) -> bool:
    """Does the script start several processes' worth of work (torch or rankwise)?"""
    for c in s.calls:
        if is_ddp(s, c.func) or s.is_api(
            c.func, "init_process_group", "DistributedSampler", unresolved=True
        ):
            return True
        if s.is_rankwise(c.func) and last_name(c.func) == "init":
            return True
    return False


def assigned_name(s: Script, call: ast.Call) -> str | None:
    """``x`` in ``x = call`` (or ``self.x = call``)."""
    stmt = s.parent.get(call)
    if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is call:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        if len(targets) == 1:
            return dotted(targets[0])
    return None


def is_move(call: ast.AST) -> bool:
    """``x.to(device)``, ``x.cuda()``, ``x.to_empty(device=...)``; not ``x.to(torch.float16)``."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return False
    attr = call.func.attr
    if attr in ("cuda", "to_empty"):
        return True
    if attr != "to":
        return False
    first = call.args[0] if call.args else None
    only_dtype = first is not None and last_name(first) in DTYPES and len(call.args) == 1
    kws = {kw.arg for kw in call.keywords}
    return not only_dtype and not (first is None and kws <= {"dtype", "memory_format"})


def contains_move(node: ast.AST) -> bool:
    return any(is_move(n) for n in ast.walk(node))


def sampler_of(s: Script, loader: ast.Call) -> ast.Call | None:
    """The DistributedSampler(...) call a DataLoader's sampler/batch_sampler may hold."""
    for expr in (call_args(loader, 3, "sampler"), call_args(loader, 4, "batch_sampler")):
        if expr is not None:
            found = s.may_be_call_to(expr, "DistributedSampler", at=loader)
            if found is not None:
                return found
    return None


def has_sampler(loader: ast.Call) -> bool:
    for expr in (call_args(loader, 3, "sampler"), call_args(loader, 4, "batch_sampler")):
        if expr is not None and not (isinstance(expr, ast.Constant) and expr.value is None):
            return True
    return False


def set_epoch_in(s: Script, node: ast.AST) -> bool:
    """Is ``.set_epoch(...)`` called in ``node`` or in a local function it calls?"""
    for part in (node, *s.local_callees(node)):
        for n in ast.walk(part):
            if isinstance(n, ast.Call) and last_name(n.func) == "set_epoch":
                return True
    return False


def names_in(node: ast.AST) -> set[str]:
    """Every dotted name read in ``node`` (``loader``, ``args.batch_size``, ``args``)."""
    out = set()
    for n in ast.walk(node):
        d = dotted(n)
        if d is not None:
            out.add(d)
    return out
