"""Rules about the one-call API: what must go through ``rt.prepare`` under several processes.

``rt.prepare(model, opt, loader)`` splits the loader over the ranks and wraps the model so its
gradients are averaged. A loader it never saw gives every rank the whole data set (RW018); a
model it never saw, or one trained before it, drifts apart on each rank (RW019). At run time
rankwise warns at the first training step and ``rt.save`` refuses drifted replicas; these rules
say it before the run. Both stay quiet in a script that never calls ``rt.prepare`` (RW004 covers
torch's own DDP scripts) and under ``strategy="single"`` or ``"dp"`` (one process).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ...strategies import STRATEGIES
from ..analysis.astutil import call_args, dotted, keyword, last_name
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import assigned_name, ddp_calls, has_sampler, loader_calls, names_in
from .ranks import runtimes

PREPARES = frozenset({"prepare", "prepare_loader"})
OPTIMIZER_MODULE = "torch.optim."


def _prepares(s: Script, which: frozenset[str] = PREPARES) -> list[ast.Call]:
    """``rt.prepare(...)`` / ``rt.prepare_loader(...)`` calls on a runtime from ``rw.init``."""
    rts = runtimes(s)
    return [
        c
        for c in s.calls
        if isinstance(c.func, ast.Attribute)
        and c.func.attr in which
        and dotted(c.func.value) in rts
    ]


def _one_process(s: Script) -> bool:
    """``rw.init(strategy="single")`` or ``"dp"``: nothing to split over processes."""
    for c in s.calls:
        if s.is_rankwise(c.func) and last_name(c.func) == "init":
            named = keyword(c, "strategy")
            value = named.value if named is not None else None
            if isinstance(value, ast.Constant) and value.value in STRATEGIES:
                return STRATEGIES[value.value].kind != "processes"
    return False


def _applies(s: Script) -> list[ast.Call]:
    """The prepare calls, when these rules apply to the script at all."""
    calls = _prepares(s)
    if not calls or ddp_calls(s) or _one_process(s):
        return []
    return calls


def _targets(s: Script, call: ast.Call) -> set[str]:
    """The names ``call``'s result is bound to (``model, opt, loader = rt.prepare(...)``)."""
    stmt = s.parent.get(call)
    if not isinstance(stmt, ast.Assign) or stmt.value is not call:
        return set()
    out = set()
    for target in stmt.targets:
        parts = target.elts if isinstance(target, ast.Tuple | ast.List) else [target]
        out |= {d for d in map(dotted, parts) if d is not None}
    return out


def _given(call: ast.Call) -> set[str]:
    """The names passed to a prepare call (its model, optimizer and loader)."""
    passed = (*call.args, *(k.value for k in call.keywords))
    return {d for d in map(dotted, passed) if d is not None}


def _has_backward(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and last_name(n.func) == "backward" for n in ast.walk(node))


def _trains(s: Script, node: ast.AST) -> bool:
    """Does ``node`` (a loop, or a call of the script's own function) run a backward?"""
    return any(_has_backward(p) for p in (node, *s.local_callees(node)))


def _training_uses(s: Script, name: str, prepares: list[ast.Call]) -> list[ast.AST]:
    """Loops over ``name`` that train, and calls passing ``name`` to a function that does."""
    out: list[ast.AST] = []
    for n in s.nodes:
        if isinstance(n, ast.For | ast.AsyncFor) and name in names_in(n.iter):
            if not any(c in prepares for c in s.calls_in(n.iter)):  # not `in rt.prepare_loader(x)`
                out += [n] if _trains(s, n) else []
        elif isinstance(n, ast.Call) and any(name == dotted(a) for a in n.args):
            f = s.function_called(n)
            out += [n] if f is not None and _has_backward(f) else []
    return out


def _streams(s: Script, loader: ast.Call) -> bool:
    """A data set that splits itself: an ``rw.ShardedIterable``, or any IterableDataset the
    script defines (the fingerprints at run time decide those)."""
    dataset = call_args(loader, 0, "dataset")
    if dataset is not None and s.may_be_call_to(dataset, "ShardedIterable", at=loader):
        return True
    return any(
        isinstance(n, ast.ClassDef) and any(last_name(b) == "IterableDataset" for b in n.bases)
        for n in s.nodes
    )


def _unprepared_use(s: Script, name: str, prepares: list[ast.Call]) -> ast.AST | None:
    """The first training use of ``name`` that reads the loader as built, not as prepared."""
    rebinds = [c for c in prepares if name in _given(c) and name in _targets(s, c)]
    passed = [c for c in prepares if name in _given(c)]
    for use in _training_uses(s, name, prepares):
        if any(c.lineno <= use.lineno for c in rebinds):
            continue  # `model, opt, loader = rt.prepare(model, opt, loader)` before it
        if passed and not any(c.lineno <= use.lineno for c in passed):
            continue  # used before prepare saw it: RW019's business (training before prepare)
        return use
    return None


@rule(
    "RW018",
    "loader-not-prepared",
    Severity.WARNING,
    "a DataLoader that rt.prepare never split is iterated by the training loop",
)
def loader_not_prepared(s: Script) -> Iterator[Hit]:
    prepares = _applies(s)
    if not prepares:
        return
    for loader in loader_calls(s):
        name = assigned_name(s, loader)
        if name is None or has_sampler(loader) or _streams(s, loader):
            continue
        use = _unprepared_use(s, name, prepares)
        if use is None:
            continue
        given = [c for c in prepares if name in _given(c)]
        how = (
            f"was given to `{s.snippet(given[0].func)}` at line {given[0].lineno}, but the "
            f"training at line {use.lineno} reads the original, not the loader it returned"
            if given
            else f"never goes through `rt.prepare` (line {prepares[0].lineno}), yet the "
            f"training at line {use.lineno} reads it"
        )
        yield (
            loader,
            f"`{name}` {how}: under several processes every rank reads the whole data set, "
            "world_size times the work per epoch, with no error.",
            f"`model, opt, {name} = rt.prepare(model, opt, {name})` and train on what it "
            f"returns (or `{name} = rt.prepare_loader({name})`, or build it with `rw.loader(...)`).",
        )


def _optimizer_calls(s: Script) -> list[ast.Call]:
    out = []
    for c in s.calls:
        q = s.qualname(c.func) or ""
        if q.startswith(OPTIMIZER_MODULE) and ".lr_scheduler." not in q and q[-1:] != "_":
            out.append(c)
    return out


def _trained_models(s: Script, opt: ast.Call) -> list[tuple[str, ast.Call]]:
    """``M`` for each ``M.parameters()`` / ``M.named_parameters()`` the optimizer is built on."""
    out = []
    for n in ast.walk(opt):
        if (
            isinstance(n, ast.Call)
            and last_name(n.func) in ("parameters", "named_parameters")
            and isinstance(n.func, ast.Attribute)
            and dotted(n.func.value) is not None
        ):
            out.append((dotted(n.func.value), n))
    return out


def _prefixes(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _prepared_names(s: Script, prepares: list[ast.Call]) -> set[str]:
    """Names that hold a prepared model: its argument, and what the call's result is bound to."""
    out: set[str] = set()
    for c in prepares:
        if c.func.attr != "prepare":
            continue
        model = call_args(c, 0, "model")
        if dotted(model) is not None:
            out.add(dotted(model))
        out |= _targets(s, c)
    return out


REFERENCE = re.compile(
    r"(^|_)(ref|reference|baseline|oracle|local|single|serial|expected|eager|plain|cpu)(_|$|\d)",
    re.IGNORECASE,
)
"""Names of a deliberate local copy (a one-process oracle to compare against): not drift."""


def _deliberate(s: Script, model: str, opt: ast.Call) -> bool:
    """A local reference model on purpose: named as one, or built and stepped on one rank."""
    return bool(REFERENCE.search(model.split(".")[-1])) or s.ctx[opt].polarity != 0


def _seen(prepares: list[ast.Call], first: int) -> str:
    if all(c.func.attr == "prepare_loader" for c in prepares):
        return f"only the loader went through `rt.prepare_loader`, line {first}"
    return f"line {first}"


def _foreign_optimizers(s: Script, prepares: list[ast.Call]) -> Iterator[Hit]:
    """Optimizers built on a model no prepare call saw (``prepares`` may hold only
    ``rt.prepare_loader`` calls: then the model was built after the loader and never prepared)."""
    prepared = _prepared_names(s, prepares)
    first = min(c.lineno for c in prepares)
    for opt in _optimizer_calls(s):
        for model, where in _trained_models(s, opt):
            if _prefixes(model) & prepared or model in ("self", "super()"):
                continue
            if _deliberate(s, model, opt):
                continue
            yield (
                where,
                f"`{s.snippet(opt.func)}` updates `{model}`, which never goes through "
                f"`rt.prepare` ({_seen(prepares, first)}): its gradients are not averaged "
                "across ranks, so each rank's copy drifts apart with no error (rt.save refuses "
                "drifted copies).",
                f"Prepare the model you train and build its optimizer from it: `{model}, opt = "
                f"rt.prepare({model}, opt)` with `opt` over `{model}.parameters()`.",
            )


def _loops_before(s: Script, call: ast.Call) -> Iterator[ast.AST]:
    """Training loops (a backward and an optimizer step) in ``call``'s function, ending before
    it and run by every rank."""
    scope = s.scope_of.get(call)
    for n in s.nodes:
        if not isinstance(n, ast.For | ast.AsyncFor | ast.While) or s.scope_of.get(n) is not scope:
            continue
        if getattr(n, "end_lineno", n.lineno) >= call.lineno or s.ctx[n].polarity != 0:
            continue
        steps = any(isinstance(c, ast.Call) and last_name(c.func) == "step" for c in ast.walk(n))
        if steps and _has_backward(n) and not s.ctx[n].loops:
            yield n


@rule(
    "RW019",
    "model-outside-prepare",
    Severity.ERROR,
    "a model trained outside rt.prepare (an optimizer over another model, or steps before it)",
)
def model_outside_prepare(s: Script) -> Iterator[Hit]:
    applies = _applies(s)
    prepares = [c for c in applies if c.func.attr == "prepare"]
    if not prepares:  # only rt.prepare_loader: a model trained here was never prepared
        yield from _foreign_optimizers(s, applies) if applies else ()
        return
    yield from _foreign_optimizers(s, prepares)
    for call in prepares:
        for loop in _loops_before(s, call):
            yield (
                loop,
                f"This loop trains before `rt.prepare` (line {call.lineno}): each rank steps "
                "its own copy, then prepare broadcasts rank 0's parameters; the other ranks' "
                "steps are lost and their optimizer state (Adam's moments) no longer matches "
                "rank 0's, so the replicas drift apart with no error.",
                "Call `model, opt, loader = rt.prepare(model, opt, loader)` before the first "
                "training step, and train only what it returns.",
            )
