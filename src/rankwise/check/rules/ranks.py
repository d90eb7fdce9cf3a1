"""Rules about which ranks run what: output on rank 0 only, collectives on every rank."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from ..analysis.astutil import call_args, dotted, last_name
from ..analysis.context import Ctx
from ..analysis.guards import mentions_rank
from ..analysis.imports import imported_function
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import is_ddp, is_distributed_script

LOG_METHODS = frozenset(
    {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}
)
TORCH_COLLECTIVES = frozenset(
    {
        "barrier",
        "monitored_barrier",
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "all_to_all",
        "all_to_all_single",
        "new_group",
    }
)
DCP = frozenset({"save", "load", "save_state_dict", "load_state_dict"})
RANKWISE_COLLECTIVES = frozenset(
    {
        "barrier",
        "all_reduce",
        "all_reduce_mean",
        "all_reduce_sum",
        "all_reduce_max",
        "all_gather_object",
        "broadcast_object",
        "gather_object",
        "save_checkpoint",
        "gather_for_metrics",
    }
)
SESSION_COLLECTIVES = frozenset({"save", "prepare", "rank_zero_first", "local_rank_zero_first"})
"""Methods of the runtime ``rw.init()`` returns that every rank must enter (``rt.log`` too, with
``reduce=``): ``rt.save`` gathers every rank's RNG state, ``rt.prepare`` broadcasts the model."""
SPAWN_CALLS = ("spawn", "start_processes")
GUARD_FIX = "Wrap it in `if rank == 0:` (or `if rt.is_master:`)"


def _loggers(s: Script) -> set[str]:
    """Names bound to ``logging.getLogger(...)`` (rankwise's get_logger is rank-aware)."""
    return {
        name
        for name, bs in s.bindings.items()
        if any(
            isinstance(b.value, ast.Call) and s.qualname(b.value.func) == "logging.getLogger"
            for b in bs
        )
    }


def _output_kind(s: Script, c: ast.Call, loggers: set[str]) -> str | None:
    r = s.resolve(c.func)
    if r is None:
        return None
    q, imported = r
    if q == "print" and not imported and "print" not in s.local_names:
        return "print"
    if imported and q.startswith("logging.") and q.split(".")[-1] in LOG_METHODS:
        return "logging"
    method = isinstance(c.func, ast.Attribute) and c.func.attr in LOG_METHODS
    return "logging" if method and dotted(c.func.value) in loggers else None


def _all_ranks(s: Script, c: ast.Call) -> bool:
    """Does every rank reach ``c`` (no rank-0 guard, not error reporting, not per-rank)?"""
    ctx = s.ctx[c]
    args = (*c.args, *(k.value for k in c.keywords))
    return ctx.polarity != 1 and not ctx.in_except and not any(mentions_rank(a, s) for a in args)


def _starts_group(s: Script, call: ast.Call) -> bool:
    """``init_process_group`` / ``rw.init``, or a call of the script's own function that makes one."""
    for part in (call, *s.local_callees(call)):
        for n in ast.walk(part):
            if isinstance(n, ast.Call) and (
                s.is_api(n.func, "init_process_group", unresolved=True)
                or (s.is_rankwise(n.func) and last_name(n.func) == "init")
            ):
                return True
    return False


def _spawns(s: Script, call: ast.Call) -> bool:
    r = s.resolve(call.func)
    return bool(r and r[1] and "multiprocessing" in r[0] and r[0].endswith(SPAWN_CALLS))


def _before_group(s: Script, c: ast.Call) -> bool:
    """Output with no rank to guard by yet: before the process group is made in the same code
    (``print(...); main()`` where main calls init_process_group), or in the process that
    starts the workers with ``mp.spawn`` (one process, not a rank)."""
    scope = s.scope_of.get(c)
    same = [o for o in s.calls if s.scope_of.get(o) is scope and o is not c]
    if any(_spawns(s, o) for o in same):
        return True
    return any(o.lineno > c.lineno and _starts_group(s, o) for o in same)


@rule(
    "RW007",
    "print-without-rank-guard",
    Severity.WARNING,
    "print/logging on every rank of a distributed script",
)
def print_without_rank_guard(s: Script) -> Iterator[Hit]:
    if not is_distributed_script(s):
        return
    loggers = _loggers(s)
    for c in s.calls:
        kind = _output_kind(s, c, loggers)
        if kind is None or not _all_ranks(s, c) or _before_group(s, c):
            continue
        yield (
            c,
            f"`{s.snippet(c)}` runs on every rank: world_size copies of each line, "
            "interleaved at different speeds (the replicas are identical, one is enough).",
            f"{GUARD_FIX}, or use `rw.print0(...)` / `rw.get_logger()` which speak on rank 0 "
            "only; to tell ranks apart on purpose, put the rank in the message.",
        )


@rule(
    "RW008",
    "save-without-rank-guard",
    Severity.WARNING,
    "torch.save on every rank of a distributed script",
)
def save_without_rank_guard(s: Script) -> Iterator[Hit]:
    if not is_distributed_script(s):
        return
    for c in s.calls:
        r = s.resolve(c.func)
        if not (r and r[1] and r[0] == "torch.save") or not _all_ranks(s, c):
            continue
        path = call_args(c, 1, "f")
        if path is not None and mentions_rank(path, s):
            continue  # one file per rank, on purpose
        yield (
            c,
            f"`{s.snippet(c)}` runs on every rank: world_size processes write the same file at "
            "once (wasted I/O, and a torn file when writes interleave); the replicas are "
            "identical, so rank 0's copy is the checkpoint.",
            _save_fix(s),
        )


def _save_fix(s: Script) -> str:
    """RW008's fix, right under every strategy: with rankwise, ``rt.save`` on every rank (under
    zero1-3 the state dicts are collectives, so a rank-0 guard around them hangs)."""
    if runtimes(s):
        return (
            "Call `rt.save(path, model=model, optimizer=opt)` on every rank (not under a rank "
            "guard): rank 0 writes, and under zero1-3 every rank must take part because "
            "`opt.state_dict()` (and, under zero3, `model.state_dict()`) gathers the shards."
        )
    return (
        "Take the state dicts on every rank, then write under `if rank == 0:` (or `if "
        "rt.is_master:`) and call `dist.barrier()` after it (outside the guard) before any rank "
        "reads the file (under FSDP/ZeRO the state dicts are collectives: never compute them "
        "inside the guard); or use `rw.save_checkpoint(...)` on every rank."
    )


def runtimes(s: Script) -> set[str]:
    """Names bound to ``rw.init(...)``: the one-call API's runtime (``rt``)."""
    return {
        name
        for name, bs in s.bindings.items()
        if any(
            isinstance(b.value, ast.Call)
            and s.is_rankwise(b.value.func)
            and last_name(b.value.func) == "init"
            for b in bs
        )
    }


def _session_collective(s: Script, c: ast.Call) -> str | None:
    f = c.func
    if not isinstance(f, ast.Attribute) or dotted(f.value) not in runtimes(s):
        return None
    reduces = f.attr == "log" and any(k.arg == "reduce" for k in c.keywords)
    return f"{dotted(f.value)}.{f.attr}" if f.attr in SESSION_COLLECTIVES or reduces else None


def _collective(s: Script, c: ast.Call) -> str | None:
    if (session := _session_collective(s, c)) is not None:
        return session
    if is_ddp(s, c.func):  # the constructor broadcasts rank 0's parameters to every rank
        return "DistributedDataParallel"
    r = s.resolve(c.func)
    if not (r and r[1]):
        return None
    parts = r[0].split(".")
    dcp = parts[2:3] == ["checkpoint"] and parts[-1] in DCP
    if parts[:2] == ["torch", "distributed"] and (parts[-1] in TORCH_COLLECTIVES or dcp):
        return r[0]
    if parts[0] == "rankwise" and parts[-1] in RANKWISE_COLLECTIVES:
        return r[0]
    return None


def _where(s: Script, ctx: Ctx) -> str:
    g = ctx.guard
    if isinstance(g, ast.If | ast.IfExp):
        return f"`if {s.snippet(g.test)}` at line {g.lineno}"
    if isinstance(g, ast.FunctionDef | ast.AsyncFunctionDef):
        return f"`@rank_zero_only` function `{g.name}` at line {g.lineno}"
    return f"line {getattr(g, 'lineno', '?')}"


def _imported_collective(s: Script, c: ast.Call) -> tuple[str, str] | None:
    """When ``c`` calls a function from one of the script's own files that runs a collective
    on every path (not under a rank guard there): its name and where, for the message."""
    target = imported_function(s, c)
    if target is None:
        return None
    module, fn = target
    for part in (fn, *module.local_callees(fn)):
        for n in module.calls_in(part):
            name = _collective(module, n)
            if name is not None and module.ctx[n].polarity == 0:
                where = f"{Path(module.path).name}:{n.lineno}"
                return name, f" runs `{module.snippet(n)}` ({where}), which"
    return None


@rule(
    "RW009",
    "collective-in-rank-branch",
    Severity.ERROR,
    "a collective (barrier, all_reduce, save_checkpoint, ...) that only some ranks reach",
)
def collective_in_rank_branch(s: Script) -> Iterator[Hit]:
    for c in s.calls:
        ctx = s.ctx[c]
        if ctx.polarity == 0:
            continue
        name, inside = _collective(s, c), ""
        if name is None and (found := _imported_collective(s, c)) is not None:
            name, inside = found
        if name is None:
            continue
        balanced = any(
            isinstance(n, ast.Call) and last_name(n.func) == last_name(c.func)
            for part in ctx.other
            for n in ast.walk(part)
        )
        if balanced:  # if rank == 0: gather(..., gather_list) else: gather(...)
            continue
        who = "rank 0" if ctx.polarity == 1 else "the ranks other than 0"
        yield (
            c,
            f"`{s.snippet(c)}`{inside} is a collective that every rank must enter, but only {who} "
            f"reach it ({_where(s, ctx)}): the others never arrive and the job hangs until the "
            "collective times out.",
            "Call it on every rank: move it out of the rank-guarded branch (do the rank-0 work "
            "inside the `if`, then the collective after it). rankwise's save_checkpoint already "
            "writes on rank 0 only; call it on all ranks.",
        )
