"""Run the rules over sources, files and directories."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .findings import Finding, Rule, Severity
from .rules import RULES
from .script import Script

# A trailing noqa comment naming rule ids (noqa, a colon, RW007, RW008) on the reported line
# silences those rules there; a bare noqa does not, so flake8/ruff comments keep their meaning.
_NOQA = re.compile(r"#\s*noqa:\s*(RW\d{3}(?:\s*,\s*RW\d{3})*)", re.IGNORECASE)


@dataclass(frozen=True)
class FileResult:
    """The findings for one file, or why it could not be checked."""

    path: str
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    error: str | None = None

    def count(self, severity: Severity) -> int:
        return sum(f.severity is severity for f in self.findings)


def select_rules(select: Iterable[str] = (), ignore: Iterable[str] = ()) -> tuple[Rule, ...]:
    """Rules by id or slug (``RW001`` or ``ddp-before-device``); all of them by default."""
    known = {r.id.lower(): r for r in RULES} | {r.slug: r for r in RULES}

    def pick(names: Iterable[str], flag: str) -> set[str]:
        out = set()
        for name in names:
            rule = known.get(name.strip().lower())
            if rule is None:
                raise ConfigError(
                    f"{flag} got unknown rule {name!r}",
                    fix=f"use a rule id or slug from `rankwise check --list-rules`: "
                    f"{', '.join(r.id for r in RULES)}",
                )
            out.add(rule.id)
        return out

    chosen = pick(select, "--select") or {r.id for r in RULES}
    dropped = pick(ignore, "--ignore")
    return tuple(r for r in RULES if r.id in chosen and r.id not in dropped)


def _suppressed(finding: Finding, lines: Sequence[str]) -> bool:
    if not 0 < finding.line <= len(lines):
        return False
    m = _NOQA.search(lines[finding.line - 1])
    return bool(m) and finding.rule in {c.strip().upper() for c in m.group(1).split(",")}


def check_source(
    source: str, path: str = "<string>", rules: Sequence[Rule] | None = None
) -> list[Finding]:
    """Findings for one script's source, sorted by position. Raises SyntaxError."""
    script = Script(source, path)
    lines = source.splitlines()
    seen, out = set(), []
    for rule in RULES if rules is None else rules:
        for f in rule.run(script):
            key = (f.line, f.column, f.rule)
            if key not in seen and not _suppressed(f, lines):
                seen.add(key)
                out.append(f)
    return sorted(out, key=lambda f: (f.line, f.column, f.rule))


def check_file(path: str | Path, rules: Sequence[Rule] | None = None) -> FileResult:
    name = str(path)
    try:
        source = Path(path).read_text(encoding="utf-8")
        return FileResult(name, tuple(check_source(source, name, rules)))
    except SyntaxError as e:
        return FileResult(name, error=f"SyntaxError: {e.msg} (line {e.lineno})")
    except (OSError, UnicodeDecodeError) as e:
        return FileResult(name, error=f"{type(e).__name__}: {e}")


def expand(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given; directories become the .py files under them, sorted."""
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return out


def check_paths(
    paths: Iterable[str | Path], rules: Sequence[Rule] | None = None
) -> list[FileResult]:
    return [check_file(p, rules) for p in expand(paths)]
