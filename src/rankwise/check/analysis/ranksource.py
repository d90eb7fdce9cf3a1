"""Parameters that hold a rank although nothing in their name says so.

``mp.spawn(main, nprocs=n)`` calls ``main(i, *args)`` with the process index ``i`` as first
argument: pytorch/examples' ddp tutorial names it ``rank`` in ``main`` and passes it on as
``Trainer(..., gpu_id=rank)``, so ``if self.gpu_id == 0:`` is a rank-0 guard. This module
finds such parameters: the first parameter of a spawned function, and any parameter of the
script's own functions (or class constructors) that a call fills with a rank, for a few rounds.

A spawn index numbers the processes of ONE machine (mp.spawn starts processes locally), so it
is neither "the global rank" nor "a LOCAL_RANK read from the launcher" for the rules that tell
those apart; it only counts as "a rank" for guards and per-rank messages.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from .astutil import last_name
from .guards import is_rank_expr

if TYPE_CHECKING:
    from .facts import ScriptFacts

SPAWNERS = frozenset({"spawn", "start_processes"})
ROUNDS = 3

RankParams = dict[ast.AST, frozenset[str]]
"""Function node -> names of its parameters that hold a rank."""


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    return names[1:] if method and names else names


def _spawned(s: ScriptFacts) -> RankParams:
    out: RankParams = {}
    for c in s.calls:
        r = s.resolve(c.func)
        if not (r and r[1] and r[0].split(".")[-1] in SPAWNERS and "multiprocessing" in r[0]):
            continue
        target = c.args[0] if c.args else next((k.value for k in c.keywords if k.arg == "fn"), None)
        fn = s.functions.get(last_name(target) or "") if target is not None else None
        if fn is not None and _params(fn, method=False):
            out[fn] = frozenset(_params(fn, method=False)[:1])
    return out


def _callee(s: ScriptFacts, call: ast.Call) -> tuple[ast.FunctionDef | None, bool]:
    """The script's own function a call runs, and whether its first parameter is ``self``."""
    name = last_name(call.func) or ""
    cls = next((n for n in s.nodes if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is not None:
        init = next(
            (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None
        )
        return init, True
    fn = s.function_called(call)
    if isinstance(fn, ast.FunctionDef):
        return fn, isinstance(call.func, ast.Attribute)
    return None, False


def rank_parameters(s: ScriptFacts) -> RankParams:
    """Every parameter that holds a rank (see the module docstring)."""
    found = _spawned(s)
    s.rank_params = found
    for _ in range(ROUNDS):
        grown = dict(found)
        for call in s.calls:
            fn, method = _callee(s, call)
            if fn is None:
                continue
            params = _params(fn, method)
            ranks = {p for p, a in zip(params, call.args, strict=False) if is_rank_expr(a, s)}
            ranks |= {k.arg for k in call.keywords if k.arg in params and is_rank_expr(k.value, s)}
            if ranks - grown.get(fn, frozenset()):
                grown[fn] = grown.get(fn, frozenset()) | frozenset(ranks)
        if grown == found:
            break
        found = grown
        s.rank_params = found
    return found
