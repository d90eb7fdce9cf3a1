"""Where each node runs: inside which loops, and on which ranks.

``annotate(script)`` walks the script once per round and gives every node a :class:`Ctx`. A
statement under ``if rank == 0:`` gets polarity +1; under ``else:`` -1; so do the statements
after an early exit such as ``if rank != 0: return``. A function whose every call site sits in
a rank-0 region is itself rank-0 only (rounds repeat until that stops changing), and so is a
function decorated with ``@rank_zero_only``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .guards import polarity

if TYPE_CHECKING:
    from .facts import ScriptFacts

FUNC_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
LOOPS = (ast.For, ast.AsyncFor, ast.While)


@dataclass(frozen=True)
class Ctx:
    loops: tuple[ast.AST, ...] = ()
    """Enclosing for/while loops in the same function, outermost first."""
    polarity: int = 0
    """+1: only rank 0 runs this; -1: only the other ranks; 0: every rank."""
    guard: ast.AST | None = None
    """The if/function that selected the ranks (for messages)."""
    other: tuple[ast.AST, ...] = ()
    """What the other ranks run instead (the opposite branch), to spot balanced collectives."""
    in_except: bool = False
    init_guarded: bool = False
    """Under ``if not dist.is_initialized():``."""


def _refine(ctx: Ctx, p: int, guard: ast.AST, other: tuple[ast.AST, ...]) -> Ctx:
    return ctx if p == 0 else replace(ctx, polarity=p, guard=guard, other=other)


def _exits(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Return | ast.Continue | ast.Break | ast.Raise):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) in ("exit", "_exit")
    return False


def _is_rank_zero_only(decorator: ast.expr) -> bool:
    d = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")) == "rank_zero_only"


class _Annotator:
    def __init__(self, script: ScriptFacts, funcs: dict[str, Ctx]) -> None:
        self.script = script
        self.funcs = funcs
        self.info: dict[ast.AST, Ctx] = {}

    def block(self, stmts: list[ast.stmt], ctx: Ctx) -> None:
        for i, st in enumerate(stmts):
            early_exit = isinstance(st, ast.If) and not st.orelse and _exits(st.body[-1])
            # The ranks that leave early still ran the exit branch; what they skip is the rest.
            self.stmt(st, ctx, rest=tuple(stmts[i + 1 :]) if early_exit else ())
            if early_exit:  # `if rank != 0: return` leaves the rest of the block to rank 0
                ctx = _refine(ctx, -polarity(st.test, self.script), st, tuple(st.body))

    def stmt(self, st: ast.stmt, ctx: Ctx, rest: tuple[ast.stmt, ...] = ()) -> None:
        self.info[st] = ctx
        if isinstance(st, FUNC_DEFS):
            self.function(st, ctx)
        elif isinstance(st, ast.If):
            self.expr(st.test, ctx)
            p = polarity(st.test, self.script)
            if "is_initialized" in ast.unparse(st.test):
                ctx = replace(ctx, init_guarded=True)
            self.block(st.body, _refine(ctx, p, st, tuple(st.orelse) or rest))
            self.block(st.orelse, _refine(ctx, -p, st, tuple(st.body)))
        elif isinstance(st, LOOPS):
            for part in (st.test,) if isinstance(st, ast.While) else (st.target, st.iter):
                self.expr(part, ctx)
            self.block(st.body, replace(ctx, loops=(*ctx.loops, st)))
            self.block(st.orelse, ctx)
        elif isinstance(st, ast.Try | getattr(ast, "TryStar", ast.Try)):
            self.block(st.body, ctx)
            for h in st.handlers:
                self.expr(h, ctx)  # marks the handler itself; its body is walked next
                self.block(h.body, replace(ctx, in_except=True))
            self.block(st.orelse, ctx)
            self.block(st.finalbody, ctx)
        else:
            self.compound(st, ctx)

    def function(self, st: ast.FunctionDef | ast.AsyncFunctionDef, ctx: Ctx) -> None:
        """Decorators run here; the body runs wherever the function is called."""
        for d in st.decorator_list:
            self.expr(d, ctx)
        self.expr(st.args, ctx)
        inner = self.funcs.get(st.name, Ctx())
        if any(_is_rank_zero_only(d) for d in st.decorator_list):
            inner = Ctx(polarity=1, guard=st)
        self.block(st.body, inner)

    def compound(self, st: ast.stmt, ctx: Ctx) -> None:
        """with / class / match bodies keep the context; simple statements are expressions."""
        if isinstance(st, ast.With | ast.AsyncWith):
            for item in st.items:
                self.expr(item, ctx)
            self.block(st.body, ctx)
        elif isinstance(st, ast.ClassDef):
            for part in (*st.decorator_list, *st.bases, *st.keywords):
                self.expr(part, ctx)
            self.block(st.body, ctx)
        elif isinstance(st, ast.Match):
            self.expr(st.subject, ctx)
            for case in st.cases:
                self.expr(case.pattern, ctx)
                if case.guard is not None:
                    self.expr(case.guard, ctx)
                self.block(case.body, ctx)
        else:
            for child in ast.iter_child_nodes(st):
                self.expr(child, ctx)

    def expr(self, e: ast.AST, ctx: Ctx) -> None:
        self.info[e] = ctx
        if isinstance(e, ast.ExceptHandler):
            if e.type is not None:
                self.expr(e.type, ctx)
            return
        if isinstance(e, ast.IfExp):  # print(...) if rank == 0 else None
            p = polarity(e.test, self.script)
            self.expr(e.test, ctx)
            self.expr(e.body, _refine(ctx, p, e, (e.orelse,)))
            self.expr(e.orelse, _refine(ctx, -p, e, (e.body,)))
        elif isinstance(e, ast.BoolOp) and isinstance(e.op, ast.And):  # rank == 0 and print(...)
            cur = ctx
            for v in e.values:
                self.expr(v, cur)
                cur = _refine(cur, polarity(v, self.script), e, ())
        else:
            for child in ast.iter_child_nodes(e):
                self.expr(child, ctx)


def _call_site_ctx(script: ScriptFacts, info: dict[ast.AST, Ctx], name: str) -> Ctx | None:
    """The shared rank context of every call to function ``name``, if all agree and select."""
    sites = []
    for n in script.loads.get(name, []):
        call = script.parent.get(n)
        if not (isinstance(call, ast.Call) and call.func is n):
            return None  # passed as a callback (mp.spawn(main, ...)): runs anywhere
        sites.append(info.get(call, Ctx()))
    if not sites or len({c.polarity for c in sites}) != 1 or sites[0].polarity == 0:
        return None
    return Ctx(polarity=sites[0].polarity, guard=sites[0].guard, other=sites[0].other)


def annotate(script: ScriptFacts) -> dict[ast.AST, Ctx]:
    """Context of every node of ``script`` (see the module docstring)."""
    funcs: dict[str, Ctx] = {}
    for _ in range(4):
        a = _Annotator(script, funcs)
        a.block(script.tree.body, Ctx())
        found = {}
        for name in script.functions:
            ctx = _call_site_ctx(script, a.info, name)
            if ctx is not None:
                found[name] = ctx
        if found == funcs:
            break
        funcs = found
    return a.info
