"""The script's own modules: ``from utils import save_model`` with ``utils.py`` beside it.

A rule that needs to know what a called function does (RW009: does it run a collective?) can
follow the call into the file that defines it. Bounded: only modules found next to the script
(or, for a relative import, in its package), imported directly by it (and a package's
``__init__`` re-export, one level), at most ``MAX_MODULES`` files per importing file, of at
most ``MAX_BYTES`` each, parsed once per script.
"""

from __future__ import annotations

import ast
from pathlib import Path
from weakref import WeakKeyDictionary

from ..script import Script
from .astutil import dotted

MAX_MODULES = 16
MAX_BYTES = 500_000

_LINKED: WeakKeyDictionary[Script, dict[str, Script]] = WeakKeyDictionary()


def _module_file(base: Path, module: str | None, level: int) -> Path | None:
    """The file of ``module`` as the script at ``base`` imports it, if it is one of its own."""
    start = base
    for _ in range(max(level - 1, 0)):
        start = start.parent
    here = start.joinpath(*(module or "").split(".")) if module else start
    for f in (here.with_suffix(".py"), here / "__init__.py"):
        if module is not None and f.is_file() and f.stat().st_size <= MAX_BYTES:
            return f
    return None


def _imports(tree: ast.Module, base: Path) -> dict[str, tuple[Path, str | None]]:
    """Local name -> (file, function name there; None: the name is the module itself)."""
    out: dict[str, tuple[Path, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if "." in a.name and not a.asname:
                    continue  # `import pkg.module` binds `pkg`
                f = _module_file(base, a.name, 0)
                if f is not None:
                    out[a.asname or a.name] = (f, None)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                sub = f"{node.module}.{a.name}" if node.module else a.name
                f = _module_file(base, sub, node.level)  # from pkg import module
                if f is not None:
                    out[a.asname or a.name] = (f, None)
                    continue
                f = _module_file(base, node.module, node.level)  # from module import function
                if f is not None:
                    out[a.asname or a.name] = (f, a.name)
    return out


def _parse(path: Path, cache: dict[Path, Script | None]) -> Script | None:
    if path not in cache:
        if len(cache) >= MAX_MODULES:
            return None
        try:
            cache[path] = Script(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            cache[path] = None
    return cache[path]


def linked(script: Script) -> dict[str, tuple[Script, str | None]]:
    """The script's own imported modules and functions, by the name the script uses."""
    if script in _LINKED:
        return _LINKED[script]  # type: ignore[return-value]
    out: dict[str, tuple[Script, str | None]] = {}
    if script.path != "<string>" and Path(script.path).is_file():
        me = Path(script.path).resolve()
        cache: dict[Path, Script | None] = {}
        for name, (f, func) in _imports(script.tree, me.parent).items():
            parsed = None if f.resolve() == me else _parse(f.resolve(), cache)
            if parsed is not None:
                out[name] = (parsed, func)
    _LINKED[script] = out  # type: ignore[assignment]
    return out


def imported_function(script: Script, call: ast.Call) -> tuple[Script, ast.AST] | None:
    """The module and function that ``call`` runs when the script imported it from one of its
    own files (``save_model(...)`` or ``utils.save_model(...)``)."""
    name = dotted(call.func)
    if name is None or name.count(".") > 1:
        return None
    head, _, attr = name.partition(".")
    found = linked(script).get(head)
    if found is None:
        return None
    module, func = found
    wanted = func if not attr and func is not None else (attr if func is None else None)
    fn = module.functions.get(wanted or "")
    again = linked(module).get(wanted or "") if fn is None else None
    if again is not None and again[1] is not None:  # a package's __init__ re-exports it
        module, fn = again[0], again[0].functions.get(again[1])
    if fn is None:
        return None
    if module.scope_of.get(fn) is not module.tree:
        return None  # a method or a nested function: not what the name means here
    return module, fn
