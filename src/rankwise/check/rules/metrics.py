"""Rules about numbers printed as the job's: a per-rank metric, or a sum printed as a mean.

Under several processes each rank computes its metric on its own share of the data. Rank 0
printing its own ``correct / total`` reports a quarter (or a half) of the evaluation as the
whole; ``dist.all_reduce(t)`` sums by default, so printing ``t`` after it reports world_size
times the mean. Neither fails; both are read as the job's result.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ..analysis.astutil import dotted, keyword, last_name
from ..analysis.guards import mentions_rank
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import is_distributed_script
from .ranks import runtimes

REDUCTIONS = frozenset(
    {
        "all_reduce",
        "all_reduce_mean",
        "all_reduce_sum",
        "all_reduce_max",
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "gather",
        "gather_object",
        "gather_for_metrics",
        "reduce",
        "reduce_scatter",
        "all_gather_tensors",
        "reduce_dict",
        "sync",
        "compute",
    }
)
"""Calls that bring every rank's value together (torch's, rankwise's, torchmetrics')."""
METRIC_NAME = re.compile(
    r"acc|correct|right|hits|total|metric|f1|precision|recall|score|auc|err|eval|val|test|top1|"
    r"top5|count|num_samples|n_samples|perplex|ppl",
    re.IGNORECASE,
)
PRINTERS = frozenset({"print", "print0", "info", "warning", "log", "write", "set_postfix"})
DIVIDES = (ast.Div, ast.FloorDiv)


def _printed_names(s: Script, call: ast.Call) -> list[ast.Name]:
    args = (*call.args, *(k.value for k in call.keywords))
    return [n for a in args for n in ast.walk(a) if isinstance(n, ast.Name)]


def _job_prints(s: Script) -> Iterator[ast.Call]:
    """Output that speaks for the job: under a rank-0 guard, or through rank 0's printers
    (``rt.print``, ``rw.print0``, ``rt.log`` without ``reduce=``); not one tagged with the rank."""
    rts = runtimes(s)
    for c in s.calls:
        name = last_name(c.func)
        if name not in PRINTERS:
            continue
        owner = dotted(c.func.value) if isinstance(c.func, ast.Attribute) else None
        rank0 = owner in rts and name in ("print", "log") and keyword(c, "reduce") is None
        rank0 = rank0 or (s.is_rankwise(c.func) and name == "print0")
        if not rank0 and s.ctx[c].polarity != 1:
            continue
        if any(mentions_rank(a, s) for a in (*c.args, *(k.value for k in c.keywords))):
            continue  # the rank in the message: per-rank on purpose
        yield c


def _chain(s: Script, name: ast.Name, at: ast.AST) -> tuple[set[str], list[ast.AST]]:
    """The names ``name`` is computed from (3 hops) and the expressions that compute them,
    augmented assignments (``correct += ...``) included."""
    names, exprs, todo = {name.id}, [], [(name.id, at, 0)]
    while todo:
        current, where, depth = todo.pop()
        found = [b.value for b in s.reaching(current, where)]
        found += [
            n.value for n in s.nodes if isinstance(n, ast.AugAssign) and dotted(n.target) == current
        ]
        found += [  # losses.append(loss.item())
            a
            for n in s.calls
            if last_name(n.func) in ("append", "extend", "add", "update")
            and isinstance(n.func, ast.Attribute)
            and dotted(n.func.value) == current
            for a in n.args
        ]
        for value in found:
            exprs.append(value)
            for n in ast.walk(value):
                if isinstance(n, ast.Name) and n.id not in names and depth < 3:
                    names.add(n.id)
                    todo.append((n.id, value, depth + 1))
    return names, exprs


def _reduced(s: Script, names: set[str], exprs: list[ast.AST]) -> bool:
    for e in exprs:
        if any(isinstance(n, ast.Call) and last_name(n.func) in REDUCTIONS for n in ast.walk(e)):
            return True
    for c in s.calls:
        if last_name(c.func) in REDUCTIONS:
            receiver = c.func.value if isinstance(c.func, ast.Attribute) else None
            passed = (*c.args, *(k.value for k in c.keywords), *([receiver] if receiver else []))
            if any(isinstance(n, ast.Name) and n.id in names for a in passed for n in ast.walk(a)):
                return True
    return False


def _per_rank_number(exprs: list[ast.AST]) -> bool:
    """Computed on this rank from a tensor: an ``.item()`` / ``.tolist()`` somewhere in it."""
    return any(
        isinstance(n, ast.Call) and last_name(n.func) in ("item", "tolist")
        for e in exprs
        for n in ast.walk(e)
    )


@rule(
    "RW020",
    "unreduced-metric-printed",
    Severity.WARNING,
    "a per-rank metric (from .item()) printed on rank 0 as the job's, never reduced",
)
def unreduced_metric_printed(s: Script) -> Iterator[Hit]:
    if not is_distributed_script(s):
        return
    seen: set[str] = set()
    for call in _job_prints(s):
        for name in _printed_names(s, call):
            if name.id in seen or not METRIC_NAME.search(name.id):
                continue
            names, exprs = _chain(s, name, call)
            if not _per_rank_number(exprs) or _reduced(s, names, exprs):
                continue
            seen.add(name.id)
            yield (
                call,
                f"`{name.id}` is computed on each rank from its own share of the data (an "
                f"`.item()`, never reduced), and `{s.snippet(call)}` prints rank 0's value as "
                "the job's: with 2 processes it covers half of the samples, and the ranks' "
                "values differ.",
                f"Reduce before printing: sum the counts over the ranks (`t = torch.tensor("
                f"[correct, total]); dist.all_reduce(t)` then divide), or `rw.all_reduce_mean("
                f"{name.id})` for a mean of equal shares, or `rt.log({name.id!r}, {name.id}, "
                "reduce='mean')`; for per-sample results use `rw.gather_for_metrics`.",
            )


def _op_is_sum(s: Script, call: ast.Call) -> bool:
    op = keyword(call, "op")
    expr = op.value if op is not None else (call.args[1] if len(call.args) > 1 else None)
    return expr is None or (last_name(expr) or "").upper() == "SUM"


def _mentions(name: str, node: ast.AST) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", ast.unparse(node)) is not None


def _divided_after(s: Script, name: str, call: ast.Call) -> bool:
    """``t /= n``, ``t.div_(n)``, ``t / n``, ``t.item() / n``: the sum made a mean."""
    scope = s.scope_of.get(call)
    for n in s.nodes:
        if s.scope_of.get(n) is not scope or getattr(n, "lineno", 0) < call.lineno:
            continue
        if isinstance(n, ast.AugAssign) and dotted(n.target) == name and isinstance(n.op, DIVIDES):
            return True
        if isinstance(n, ast.BinOp) and isinstance(n.op, DIVIDES) and _mentions(name, n.left):
            return True
        divides = isinstance(n, ast.Call) and last_name(n.func) in ("div_", "div", "mean")
        if divides and _mentions(name, n):
            return True
    return False


def _sum_like(name: str) -> bool:
    return bool(re.search(r"sum|total|count|correct|num|^n_|hits", name, re.IGNORECASE))


@rule(
    "RW021",
    "all-reduce-sum-printed",
    Severity.WARNING,
    "dist.all_reduce(t) (a sum) then t printed as if it were the mean",
)
def all_reduce_sum_printed(s: Script) -> Iterator[Hit]:
    for c in s.calls:
        r = s.resolve(c.func)
        if not (r and r[1] and r[0].endswith(".all_reduce") and c.args and _op_is_sum(s, c)):
            continue
        name = dotted(c.args[0])
        if name is None or _sum_like(name) or _divided_after(s, name, c):
            continue
        for p in s.calls:
            if p.lineno <= c.lineno or last_name(p.func) not in PRINTERS:
                continue
            if s.scope_of.get(p) is not s.scope_of.get(c):
                continue
            if not any(_mentions(name, a) for a in (*p.args, *(k.value for k in p.keywords))):
                continue
            yield (
                p,
                f"`{s.snippet(c)}` (line {c.lineno}) sums `{name}` over the ranks (all_reduce's "
                f"op is SUM unless told otherwise), and `{s.snippet(p)}` prints that sum: "
                "world_size times the mean.",
                f"Divide by the number of processes after the all_reduce (`{name} /= "
                "dist.get_world_size()`), or use `rw.all_reduce_mean(...)`, which returns the "
                "mean.",
            )
            break
