"""The claims registry: every quantitative or equality claim in README.md and docs/*.md names
what measures it, in a marker right after it:

    ... bitwise equal to torch's DDP. <!-- claim: tests/dist/test_recipes.py::test_recipe_trains_as_torch_does -->
    ... 8.8% slower. <!-- claim: benchmarks/results/checkpoint_verify.json#load -->

A test marker names a file under tests/ and a test function in it (``::Class::test`` and a
parametrised id ``test[x]`` are accepted by base name); a benchmark marker names a JSON file
under benchmarks/results/, optionally ``#key`` (``#a/b`` for nested keys) that must exist in it.

**What is a claim** (``CLAIM``): bit-equality words (bitwise, bit for bit, bit-exact,
bit-identical), bounds (``≤ 4 s``, ``>= 2``), ``within X`` (%, s, ms, x, 1e-6...), numbers in
scientific notation (``1e-6``, ``2.4e-7``), multipliers (``1.5x``, ``2×``) and percentages.
Fenced code, inline code, link targets and the markers themselves are not read.

**Right after it**: a marker between the claim and the end of its sentence, or just after that
end (only spaces between; several markers may follow one another). A claim in a table is
covered by a marker anywhere in the table, on the line right after it, or in the paragraph
right before it (where a table's source is usually named).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

CLAIM = re.compile(
    "|".join(
        (
            r"\bbit(?:wise|[- ]for[- ]bit|[- ]exact(?:ly)?|[- ]identical)\b",
            r"(?<![\w<>=!])(?:≤|≥|<=|>=)\s*~?\d",
            r"\bwithin\s+(?:about\s+)?\d[\d.]*(?:e-?\d+)?\s*(?:%|x\b|×|ms\b|s\b|µs\b|MB\b|MiB\b|GB\b|GiB\b|P\b)",
            r"\b\d(?:\.\d+)?e-\d+\b",
            r"(?<![\w.])\d+(?:\.\d+)?(?:x|×)(?![\w])",
            r"(?<![\w.])[+-]?\d+(?:\.\d+)?\s?%",
        )
    ),
    re.IGNORECASE,
)
MARKER = re.compile(r"<!--\s*claim:\s*(?P<target>[^\s>]+)\s*-->")
_ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "etc.", "cf.", "approx.")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.why}: {self.text}"


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def _blank_fences(text: str) -> str:
    return re.sub(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", _blank, text, flags=re.M | re.S)


def _blank_code(text: str) -> str:
    """Fenced blocks, inline code and link targets replaced by spaces (offsets kept)."""
    blank = _blank
    text = re.sub(r"`[^`\n]*`", blank, _blank_fences(text))
    return re.sub(r"\]\([^)\n]*\)", lambda m: "]" + blank(m)[1:], text)


def _blocks(text: str) -> list[tuple[int, int, bool]]:
    """``(start, end, is_table)`` offsets of paragraphs, list items and tables."""
    out, start, kind, pos = [], None, None, 0
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        this = "table" if stripped.startswith("|") else ("blank" if not stripped else "text")
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s", line) is not None
        heading = stripped.startswith("#")
        if start is not None and (this != kind or item or heading or this == "blank"):
            out.append((start, pos, kind == "table"))
            start = None
        if this != "blank" and start is None:
            start, kind = pos, this
        if heading and start is not None:
            out.append((start, pos + len(line), False))
            start = None
        pos += len(line)
    if start is not None:
        out.append((start, pos, kind == "table"))
    return out


def _sentence_end(prose: str, at: int, end: int) -> int:
    for m in _SENTENCE_END.finditer(prose, at, end):
        before = prose[max(0, m.start() - 6) : m.end()]
        if not before.endswith(_ABBREVIATIONS):
            return m.end()
    return end


def _marked_after(raw: str, at: int, end: int, block_end: int) -> bool:
    """A marker starts in [at, end), or right after ``end`` (spaces between)."""
    if MARKER.search(raw, at, end):
        return True
    rest = raw[end:block_end]
    return MARKER.match(rest.lstrip()) is not None


def unmarked_claims(path: Path, root: Path) -> list[Finding]:
    raw = path.read_text(encoding="utf-8")
    plain = MARKER.sub(lambda m: " " * len(m.group(0)), raw)
    prose = _blank_code(plain)
    rel = str(path.relative_to(root))
    blocks = _blocks(_blank_fences(plain))  # where lists and tables start: the text as written
    out = []
    for i, (start, end, table) in enumerate(blocks):
        for m in CLAIM.finditer(prose, start, end):
            if table:
                before = blocks[i - 1][0] if i > 0 and not blocks[i - 1][2] else start
                covered = MARKER.search(raw, before, end) is not None or _marked_after(
                    raw, end, end, len(raw)
                )
            else:
                stop = _sentence_end(prose, m.end(), end)
                covered = _marked_after(raw, m.start(), stop, end)
            if not covered:
                line = raw.count("\n", 0, m.start()) + 1
                sentence = " ".join(prose[start:end].split())
                out.append(
                    Finding(rel, line, sentence[:300], f"claim {m.group(0)!r} without a marker")
                )
    return _one_per_line(out)


def _one_per_line(found: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in found:
        if (f.file, f.line) not in seen:
            seen.add((f.file, f.line))
            out.append(f)
    return out


def _test_names(file: Path) -> set[str]:
    tree = ast.parse(file.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{f.name}"
                for f in node.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    return names


def _json_has(data: object, key: str) -> bool:
    for part in key.split("/"):
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return False
    return True


def target_problem(target: str, root: Path) -> str | None:
    """Why a marker's target names nothing (None when it names something real)."""
    if "::" in target:
        file, _, name = target.partition("::")
        name = re.sub(r"\[.*\]$", "", name)
        path = root / file
        if not file.startswith("tests/") or not file.endswith(".py") or not path.is_file():
            return f"no test file {file}"
        if name not in _test_names(path):
            return f"no test {name} in {file}"
        return None
    file, _, key = target.partition("#")
    path = root / file
    if not file.startswith("benchmarks/results/") or not path.is_file():
        return f"no benchmark result {file} (a test is named file.py::test_name)"
    if key:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            return f"{file} is not JSON: {exc}"
        if not _json_has(data, key):
            return f"no key {key!r} in {file}"
    return None


def bad_markers(path: Path, root: Path) -> list[Finding]:
    raw = path.read_text(encoding="utf-8")
    rel = str(path.relative_to(root))
    out = []
    for m in re.finditer(r"<!--\s*claim\b.*?(?:-->|$)", raw, flags=re.M):
        if not MARKER.fullmatch(m.group(0)):
            line = raw.count("\n", 0, m.start()) + 1
            out.append(Finding(rel, line, m.group(0), "malformed marker (one target, then -->)"))
    for m in MARKER.finditer(raw):
        why = target_problem(m.group("target"), root)
        if why is not None:
            line = raw.count("\n", 0, m.start()) + 1
            out.append(Finding(rel, line, m.group(0), f"marker names nothing ({why})"))
    return out


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
