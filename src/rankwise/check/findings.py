"""What a check reports: rules (stable id + slug + severity) and the findings they produce."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: rules import this module, not the other way round
    from .script import Script


class Severity(str, Enum):
    """``error``: the run crashes, hangs or trains wrongly. ``warning``: noise, waste or risk."""

    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem at one place in one script."""

    path: str
    """The script as it was named on the command line."""
    line: int
    """1-based line of the offending node (the first line of a multi-line statement)."""
    column: int
    """1-based column of the offending node."""
    rule: str
    """Stable rule id, e.g. ``RW001``."""
    slug: str
    """Stable rule name, e.g. ``ddp-before-device``."""
    severity: Severity
    message: str
    """What is wrong here, with the script's own names and lines."""
    fix: str
    """What to change."""

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "rule": self.rule,
            "slug": self.slug,
            "severity": self.severity.value,
            "message": self.message,
            "fix": self.fix,
        }


# A rule body yields (node, message, fix); the runner turns those into Findings.
Hit = tuple[ast.AST, str, str]
CheckFn = Callable[["Script"], Iterator[Hit]]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A rule's identity and the function that finds it."""

    id: str
    slug: str
    severity: Severity
    summary: str
    check: CheckFn

    def run(self, script: Script) -> list[Finding]:
        found = []
        for node, message, fix in self.check(script):
            found.append(
                Finding(
                    path=script.path,
                    line=getattr(node, "lineno", 1),
                    column=getattr(node, "col_offset", 0) + 1,
                    rule=self.id,
                    slug=self.slug,
                    severity=self.severity,
                    message=message,
                    fix=fix,
                )
            )
        return found


def rule(id: str, slug: str, severity: Severity, summary: str) -> Callable[[CheckFn], Rule]:
    """Decorator: turn a generator of hits into a registered :class:`Rule`."""

    def wrap(fn: CheckFn) -> Rule:
        return Rule(id=id, slug=slug, severity=severity, summary=summary, check=fn)

    return wrap
