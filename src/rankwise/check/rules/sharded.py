"""Rules about sharded strategies: what becomes a collective once ZeRO splits the state.

Under ``zero1``-``zero3`` each rank holds a shard of the optimizer state, so
``opt.state_dict()`` gathers every rank's shard; under ``zero3`` the parameters are sharded too,
so the model's forward and ``model.state_dict()`` gather each unit's parameters. Each is a
collective: called under ``if rank == 0:`` (the usual way to save or evaluate on one rank) it
waits for ranks that never come, and the job hangs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ...strategies import STRATEGIES
from ..analysis.astutil import dotted, keyword, last_name
from ..findings import Hit, Severity, rule
from ..script import Script
from .ranks import _where, runtimes


def zero_stage(s: Script) -> int:
    """The ZeRO stage of ``rw.init(strategy="zeroN")`` in the script, 0 when none or unknown."""
    for c in s.calls:
        if s.is_rankwise(c.func) and last_name(c.func) == "init":
            named = keyword(c, "strategy")
            value = named.value if named is not None else None
            if isinstance(value, ast.Constant) and value.value in STRATEGIES:
                return STRATEGIES[value.value].zero_stage
    return 0


def _prepared(s: Script) -> tuple[set[str], set[str]]:
    """(model names, optimizer names) that ``rt.prepare(model, opt, ...)`` got or returned."""
    rts = runtimes(s)
    models: set[str] = set()
    opts: set[str] = set()
    for c in s.calls:
        if not (isinstance(c.func, ast.Attribute) and c.func.attr == "prepare"):
            continue
        if dotted(c.func.value) not in rts:
            continue
        stmt = s.parent.get(c)
        targets = []
        if isinstance(stmt, ast.Assign) and stmt.value is c:
            t = stmt.targets[0]
            targets = list(t.elts) if isinstance(t, ast.Tuple | ast.List) else [t]
        for part in (c.args, targets):
            names = [dotted(p) for p in part]
            if names and names[0]:
                models.add(names[0])
            if len(names) > 1 and names[1]:
                opts.add(names[1])
    return models, opts


def _what(s: Script, c: ast.Call, models: set[str], opts: set[str], stage: int) -> str | None:
    """What sharded collective ``c`` is, or None."""
    f = c.func
    if isinstance(f, ast.Attribute) and f.attr == "state_dict":
        owner = dotted(f.value)
        if owner in opts and stage >= 1:
            return "the sharded optimizer's state_dict() (it gathers every rank's shard)"
        if owner in models and stage == 3:
            return "the ZeRO-3 model's state_dict() (it gathers every unit's parameters)"
    if stage == 3 and isinstance(f, ast.Name) and f.id in models:
        return "a forward of the ZeRO-3 model (it gathers each unit's parameters)"
    gathers = isinstance(f, ast.Attribute) and f.attr == "full_parameters"
    if stage == 3 and gathers and dotted(f.value) in runtimes(s):
        return "`rt.full_parameters` under zero3 (it gathers every unit's parameters)"
    return None


@rule(
    "RW022",
    "sharded-state-in-rank-branch",
    Severity.ERROR,
    "under ZeRO, opt.state_dict() (or, under zero3, model(x) / model.state_dict()) on some "
    "ranks only",
)
def sharded_state_in_rank_branch(s: Script) -> Iterator[Hit]:
    stage = zero_stage(s)
    if stage == 0:
        return
    models, opts = _prepared(s)
    for c in s.calls:
        ctx = s.ctx[c]
        if ctx.polarity == 0:
            continue
        what = _what(s, c, models, opts, stage)
        if what is None:
            continue
        who = "rank 0" if ctx.polarity == 1 else "the ranks other than 0"
        yield (
            c,
            f"`{s.snippet(c)}` is {what}: under zero{stage} a collective every rank must "
            f"enter, but only {who} reach it ({_where(s, ctx)}): the others never arrive and "
            "the job hangs until the timeout.",
            "Call it on every rank: `rt.save(path, model=model, optimizer=opt)` on every rank "
            "saves (rank 0 writes); to evaluate, run the model on every rank and print with "
            "`rt.print`, or enter `with rt.full_parameters(model) as bare:` on every rank and "
            "call `bare(x)` under the rank guard.",
        )
