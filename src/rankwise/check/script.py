"""A parsed training script plus the facts every rule needs.

The rules ask simple questions — "what does this name mean?", "what was this variable bound to
before line N?", "is this call torch's DistributedDataParallel?" — and this module answers them
once: import aliases, assignments per scope, parents, and (through :mod:`.context`) the loop and
rank-guard context of every node. It is deliberately a flow-insensitive approximation that reads
statements in source order: training scripts are straight-line code, and a checker that guesses
on branch-heavy code should stay silent rather than shout.
"""

from __future__ import annotations

import ast

from .analysis import context, ranksource
from .analysis.astutil import dotted, last_name, pos
from .analysis.facts import Binding

ROOTS = ("torch", "rankwise")
FUNC_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


class Script:
    """One parsed script. Raises SyntaxError when the source does not parse."""

    def __init__(self, source: str, path: str = "<string>") -> None:
        self.path = path
        self.source = source
        self.tree = ast.parse(source, filename=path)
        self.parent: dict[ast.AST, ast.AST] = {}
        self.scope_of: dict[ast.AST, ast.AST] = {}
        self._index(self.tree, self.tree)
        self.nodes = sorted(self.scope_of, key=pos)
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]
        self.functions = {n.name: n for n in self.nodes if isinstance(n, FUNC_DEFS)}
        self.local_names = set(self.functions) | {
            n.name for n in self.nodes if isinstance(n, ast.ClassDef)
        }
        # Every read of a name or attribute, by identifier: `f` and `self.f` both count for f.
        self.loads: dict[str, list[ast.Name | ast.Attribute]] = {}
        for n in self.nodes:
            if isinstance(n, ast.Name | ast.Attribute) and isinstance(n.ctx, ast.Load):
                self.loads.setdefault(last_name(n) or "", []).append(n)
        self.aliases = self._aliases()
        self.bindings = self._bindings()
        self.rank_params: dict[ast.AST, frozenset[str]] = {}
        self.rank_params = ranksource.rank_parameters(self)
        self.ctx = context.annotate(self)

    # ----------------------------------------------------------------- indexing
    def _index(self, node: ast.AST, scope: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            self.parent[child] = node
            self.scope_of[child] = scope
            inner = child if isinstance(child, SCOPES) else scope
            self._index(child, inner)

    def _aliases(self) -> dict[str, str]:
        """Local name -> dotted module path, from imports and ``X = module.attr`` aliasing."""
        out: dict[str, str] = {}
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = a.name
                    else:  # `import torch.distributed` binds `torch`
                        root = a.name.split(".")[0]
                        out[root] = root
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in self.nodes:  # `DDP = torch.nn.parallel.DistributedDataParallel`
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute | ast.Name)
            ):
                resolved = self.resolve(node.value, out)
                if resolved and resolved[1]:
                    out[node.targets[0].id] = resolved[0]
        return out

    def _bindings(self) -> dict[str, list[Binding]]:
        out: dict[str, list[Binding]] = {}
        for node in self.nodes:
            pairs: list[tuple[ast.expr, ast.expr]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.AugAssign):  # x //= n  is  x = x // n
                op = ast.BinOp(left=node.target, op=node.op, right=node.value)
                pairs = [(node.target, ast.copy_location(op, node))]
            for target, value in pairs:
                name = dotted(target)
                if name is not None:
                    b = Binding(name, value, node, self.scope_of[node])
                    out.setdefault(name, []).append(b)
        return out

    # ----------------------------------------------------------------- names
    def resolve(
        self, expr: ast.AST, aliases: dict[str, str] | None = None
    ) -> tuple[str, bool] | None:
        """(qualified name, whether its root came from an import) for a Name/Attribute chain."""
        d = dotted(expr)
        if d is None:
            return None
        aliases = self.aliases if aliases is None else aliases
        root, _, rest = d.partition(".")
        if root in aliases:
            full = aliases[root]
            return (f"{full}.{rest}" if rest else full), True
        return d, False

    def qualname(self, expr: ast.AST) -> str | None:
        r = self.resolve(expr)
        return None if r is None else r[0]

    def is_api(self, expr: ast.AST, *names: str, unresolved: bool = False) -> bool:
        """Is ``expr`` torch's or rankwise's ``name`` (under any import alias)?

        ``unresolved=True`` also accepts names whose root was never imported (``nn.DataParallel``
        in a snippet, a star import), unless the script defines that name itself.
        """
        r = self.resolve(expr)
        if r is None:
            return False
        q, imported = r
        parts = q.split(".")
        if parts[-1] not in names:
            return False
        if imported:
            return parts[0] in ROOTS
        return unresolved and parts[0] not in self.local_names and parts[0] != "self"

    def is_call_to(self, node: ast.AST, *names: str, unresolved: bool = False) -> bool:
        return isinstance(node, ast.Call) and self.is_api(node.func, *names, unresolved=unresolved)

    def is_rankwise(self, expr: ast.AST) -> bool:
        """Was ``expr`` imported from rankwise (``rw.DistributedDataParallel``)?"""
        r = self.resolve(expr)
        return bool(r and r[1] and r[0].split(".")[0] == "rankwise")

    # ----------------------------------------------------------------- data flow
    def reaching(self, name: str, at: ast.AST) -> list[Binding]:
        """Bindings of ``name`` that may hold at ``at``: the latest one before it in the same
        scope (falling back to module scope), plus earlier ones in a mutually exclusive branch.
        Attribute names (``self.model``) are looked up across all scopes."""
        every = self.bindings.get(name, [])
        if "." in name:
            return list(every)
        line = pos(at)[0]
        scope = self.scope_of.get(at, self.tree)
        cands = [b for b in every if b.scope is scope and b.stmt.lineno < line]
        if not cands and scope is not self.tree:
            if any(b.scope is scope for b in every):
                return []  # a local bound only later: not ours to guess
            cands = [b for b in every if b.scope is self.tree]
        if not cands:
            return []
        out = [cands[-1]]
        for b in reversed(cands[:-1]):
            if not self.exclusive(b.stmt, out[-1].stmt):
                break
            out.append(b)
        return out

    def values(self, expr: ast.AST, at: ast.AST | None = None, depth: int = 2) -> list[ast.AST]:
        """``expr`` itself plus what its names may have been bound to (``depth`` hops)."""
        out: list[ast.AST] = [expr]
        if depth == 0:
            return out
        for node in ast.walk(expr):
            name = dotted(node)
            if name is None or not isinstance(getattr(node, "ctx", None), ast.Load):
                continue
            for b in self.reaching(name, at or expr):
                out.extend(self.values(b.value, b.stmt, depth - 1))
        return out

    def may_be_call_to(
        self, expr: ast.AST, *names: str, at: ast.AST | None = None
    ) -> ast.Call | None:
        """A call to ``names`` that ``expr`` contains or may hold through its variables."""
        for value in self.values(expr, at):
            for node in ast.walk(value):
                if self.is_call_to(node, *names, unresolved=True):
                    return node
        return None

    # ----------------------------------------------------------------- structure
    def ancestors(self, node: ast.AST) -> list[ast.AST]:
        out = []
        while node in self.parent:
            node = self.parent[node]
            out.append(node)
        return out

    def exclusive(self, a: ast.AST, b: ast.AST) -> bool:
        """Can ``a`` and ``b`` not both run? (if/else branches; a try body and its handler)."""
        path_a = [a, *self.ancestors(a)]
        path_b = [b, *self.ancestors(b)]
        common = next((n for n in path_a if n in set(path_b)), None)
        if common is None or common is a or common is b:
            return False
        ca, cb = path_a[path_a.index(common) - 1], path_b[path_b.index(common) - 1]
        if isinstance(common, ast.If):
            branches = {_branch(common, ca), _branch(common, cb)}
            return branches == {"body", "orelse"}
        if isinstance(common, ast.Try):  # except: runs because the body failed
            return isinstance(ca, ast.ExceptHandler) != isinstance(cb, ast.ExceptHandler)
        return False

    def calls_in(self, node: ast.AST) -> list[ast.Call]:
        return [n for n in ast.walk(node) if isinstance(n, ast.Call)]

    def local_callees(self, node: ast.AST, depth: int = 2) -> list[ast.AST]:
        """Bodies of the script's own functions called inside ``node`` (``depth`` levels)."""
        out: list[ast.AST] = []
        frontier = [node]
        for _ in range(depth):
            nxt = []
            for n in frontier:
                for call in self.calls_in(n):
                    f = self.function_called(call)
                    if f is not None and f not in out and f is not node:
                        out.append(f)
                        nxt.append(f)
            frontier = nxt
        return out

    def function_called(self, call: ast.Call) -> ast.AST | None:
        """The script's own function (or ``self.`` method) that ``call`` runs, if any."""
        name = dotted(call.func) or ""
        if name.startswith("self.") and name.count(".") == 1:
            name = name[5:]
        return self.functions.get(name)

    def mentions(self, node: ast.AST, pred) -> bool:
        return any(pred(n) for n in ast.walk(node))

    def snippet(self, node: ast.AST, limit: int = 60) -> str:
        text = ast.unparse(node)
        return text if len(text) <= limit else text[: limit - 3] + "..."


def _branch(node: ast.If, child: ast.AST) -> str | None:
    if child in node.body:
        return "body"
    if child in node.orelse:
        return "orelse"
    return None
