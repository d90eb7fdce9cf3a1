"""Every module path our prose names exists: the docstrings of src/rankwise and docs/*.md,
README.md. A module that moves leaves no sentence pointing at its old place.

What is checked, and how it resolves:

- ``rankwise.a.b.C``: the longest prefix that is a module of ours, the rest attributes of it
  (classes' annotated fields count); ``rankwise.toml`` and other file names are not modules.
- ``folder/file.py`` whose first folder is a top folder of the repository (``tests/...``) or a
  package of src/rankwise (``parallel/...``), or, deeper (``zero/layout.py``), whose file name
  is one of ours: from the repository root, from src/ or src/rankwise/, from the mentioning
  file's folder, or as the tail of one of our files.
- A bare ``file.py`` in a docstring of src/rankwise, when a module of ours has that name: a
  sibling of the module that names it (elsewhere, give the folder: ``rankwise/validate.py``).

Paths that are not ours are ignored: ``torch.x``, ``mnist/main.py``, ``ddp/example.py`` of
pytorch/examples, a user's ``train.py``; so are bare file names in the docs, which name users'
scripts as often as ours.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC, PKG = ROOT / "src", ROOT / "src" / "rankwise"
OUR_TREES = ("src", "tests", "benchmarks", "tools", "examples")
NOT_MODULES = {"py", "toml", "json", "yaml", "yml", "txt", "md", "log", "pt", "lock"}

DOTTED = re.compile(r"(?<![\w./-])rankwise(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_]\w*\.py)\b")


def _our_files() -> list[Path]:
    return [
        p.relative_to(ROOT)
        for tree in OUR_TREES
        for p in (ROOT / tree).rglob("*.py")
        if "__pycache__" not in p.parts
    ]


FILES = _our_files()
NAMES = {p.name for p in FILES}
MODULE_NAMES = {p.name for p in PKG.rglob("*.py")}
TOP = {d.name for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")}
TOP |= {d.name for d in PKG.iterdir() if d.is_dir() and d.name != "__pycache__"}
DEEP = {d.name for d in PKG.rglob("*") if d.is_dir() and d.name != "__pycache__"} - TOP


def _texts() -> list[tuple[Path, str]]:
    """(file, text): every docstring of src/rankwise, every page of the docs."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    out.append((path, doc))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        out.append((path, path.read_text()))
    return out


def _module_file(parts: list[str]) -> Path | None:
    base = SRC.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _has(obj: object, name: str) -> tuple[bool, object]:
    if hasattr(obj, name):
        return True, getattr(obj, name)
    if isinstance(obj, type):  # a dataclass field or an annotated attribute
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        annotated = any(name in getattr(c, "__annotations__", {}) for c in obj.__mro__)
        return name in fields or annotated, None
    return False, None


def dotted_exists(path: str) -> bool:
    parts = path.split(".")
    if parts[-1] in NOT_MODULES:
        return True  # a file name (rankwise.toml), not a module
    k = len(parts)
    while k and _module_file(parts[:k]) is None:
        k -= 1
    if not k:
        return False
    if k == len(parts):
        return True
    obj: object = importlib.import_module(".".join(parts[:k]))
    for name in parts[k:]:
        if obj is None:
            return True  # an annotated attribute's own attributes: not ours to check
        found, obj = _has(obj, name)
        if not found:
            return False
    return True


def file_exists(mention: str, where: Path) -> bool:
    """Whether ``mention`` (a .py path) names one of our files, seen from ``where``."""
    if "/" not in mention:
        if where.suffix == ".py":  # a docstring: a sibling
            return mention not in MODULE_NAMES or (where.parent / mention).is_file()
        return True  # the docs: a user's script as often as ours
    first, name = mention.split("/")[0], mention.rpartition("/")[2]
    if first not in TOP and not (first in DEEP and name in NAMES):
        return True  # not ours (mnist/main.py, pytorch/examples' ddp/example.py)
    bases = (ROOT, SRC, PKG, where.parent)
    if any((base / mention).is_file() for base in bases):
        return True
    return any(str(f).endswith("/" + mention) for f in FILES)


def stale_mentions() -> list[str]:
    stale = set()
    for where, text in _texts():
        shown = where.relative_to(ROOT)
        for m in DOTTED.finditer(text):
            if not dotted_exists(m.group(0)):
                stale.add(f"{shown}: {m.group(0)}")
        for m in FILE.finditer(text):
            if not file_exists(m.group(1), where):
                stale.add(f"{shown}: {m.group(1)}")
    return sorted(stale)


def test_every_module_path_named_in_docstrings_and_docs_exists():
    assert stale_mentions() == []


def test_the_check_finds_a_moved_module():
    """The rules catch what they are for, and let through what is not ours."""
    here = PKG / "parallel" / "zero" / "sharded.py"
    assert not dotted_exists("rankwise.parallel.tensor.tiny_gpt")
    assert not dotted_exists("rankwise.models.GPT.no_such_method")
    assert dotted_exists("rankwise.models.GPT.generate")
    assert dotted_exists("rankwise.parallel.zero.layout")
    assert dotted_exists("rankwise.toml")
    assert not file_exists("parallel/tensor/tiny_gpt.py", here)
    assert file_exists("zero/layout.py", here) and file_exists("layout.py", here)
    assert not file_exists("flat.py", here)  # ours, but not in parallel/zero/
    assert not file_exists("zero/flat.py", here)  # the folder and the name are ours
    assert file_exists("train.py", here) and file_exists("mnist/main.py", here)
    assert file_exists("ddp/example.py", here)  # pytorch/examples': example.py is not ours
