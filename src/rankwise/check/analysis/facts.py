"""What the rank and loop analyses read of a parsed script, as a type: the leaf that
``context``, ``guards`` and ``ranksource`` depend on, so that ``script`` (which runs them while
it builds itself) is the only module that knows all four.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Binding:
    """``name = value`` somewhere in the script (``name`` may be dotted: ``args.batch_size``)."""

    name: str
    value: ast.expr
    stmt: ast.stmt
    scope: ast.AST


class ScriptFacts(Protocol):
    """The facts of :class:`rankwise.check.script.Script` the analyses use."""

    tree: ast.Module
    parent: dict[ast.AST, ast.AST]
    scope_of: dict[ast.AST, ast.AST]
    nodes: list[ast.AST]
    calls: list[ast.Call]
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]
    loads: dict[str, list[ast.Name | ast.Attribute]]
    bindings: dict[str, list[Binding]]
    rank_params: dict[ast.AST, frozenset[str]]
    """Function node -> its parameters that hold a rank (empty while they are computed)."""

    def resolve(
        self, expr: ast.AST, aliases: dict[str, str] | None = None
    ) -> tuple[str, bool] | None: ...

    def function_called(self, call: ast.Call) -> ast.AST | None: ...
