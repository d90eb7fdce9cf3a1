"""Findings as text for people and as JSON for tools (schema in docs/check.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .findings import Severity
from .runner import FileResult

SCHEMA = "rankwise.check/1"


def summary(results: Sequence[FileResult]) -> dict[str, int]:
    return {
        "files": len(results),
        "errors": sum(r.count(Severity.ERROR) for r in results),
        "warnings": sum(r.count(Severity.WARNING) for r in results),
        "unreadable": sum(r.error is not None for r in results),
    }


def exit_code(results: Sequence[FileResult], strict: bool = False) -> int:
    """2: a file could not be checked; 1: errors (or, with strict, warnings); 0: clean."""
    s = summary(results)
    if s["unreadable"]:
        return 2
    return 1 if s["errors"] or (strict and s["warnings"]) else 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def to_text(results: Sequence[FileResult]) -> str:
    lines = []
    for r in results:
        if r.error is not None:
            lines.append(f"{r.path}: cannot check: {r.error}")
        for f in r.findings:
            lines.append(
                f"{f.path}:{f.line}:{f.column}: {f.rule} {f.severity.value} [{f.slug}] {f.message}"
            )
            lines.append(f"    fix: {f.fix}")
    s = summary(results)
    if s["errors"] or s["warnings"]:
        lines.append(
            f"Found {_plural(s['errors'], 'error')} and {_plural(s['warnings'], 'warning')} "
            f"in {_plural(s['files'], 'file')}."
        )
    elif not s["unreadable"]:
        lines.append(f"No pitfalls found in {_plural(s['files'], 'file')}.")
    return "\n".join(lines)


def to_json(results: Sequence[FileResult]) -> str:
    doc = {
        "schema": SCHEMA,
        "files": [
            {
                "path": r.path,
                "error": r.error,
                "findings": [f.to_dict() for f in r.findings],
            }
            for r in results
        ],
        "summary": summary(results),
    }
    return json.dumps(doc, indent=2)
