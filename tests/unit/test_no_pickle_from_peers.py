"""No internal path of rankwise unpickles what another rank (or an untrusted file) sends.

A static scan of src/: calls of torch's object collectives, ``pickle.load(s)`` and ``torch.load``
without ``weights_only=True`` are allowed only in the few functions listed below, each for a
documented reason. A new call elsewhere fails here: use ``rankwise.comm.wire`` (JSON and tensors).
"""

from __future__ import annotations

import ast
from pathlib import Path

import rankwise

SRC = Path(rankwise.__file__).parent
UNPICKLING = {
    "all_gather_object",
    "broadcast_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "recv_object_list",
    "send_object_list",
    "loads",  # pickle.loads
    "load",  # pickle.load, torch.load (checked for weights_only=True)
}
ALLOWED = {
    # rw.broadcast_object / rw.all_gather_object / rw.gather_object: for user code, documented
    # as trusting every rank (docs/pitfalls.md).
    ("comm/collectives.py", "broadcast_object"),
    ("comm/collectives.py", "all_gather_object"),
    ("comm/collectives.py", "gather_object"),
    # load_checkpoint(trusted=True): the caller says it trusts the file.
    ("checkpoint/single.py", "_load"),
    # rw.launch: the caller's own children report results through a local pipe (same user).
    ("launch/child.py", "pickled_exception"),
    ("launch/spawn.py", "_receive"),
}


def _name(func: ast.expr) -> tuple[str, str]:
    """(owner, attribute) of a call: ('pickle', 'loads'), ('dist', 'all_gather_object')."""
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return owner, func.attr
    if isinstance(func, ast.Name):
        return "", func.id
    return "", ""


def _safe_torch_load(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def _violations(tree: ast.AST, rel: str) -> list[str]:
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            if isinstance(child, ast.Call):
                owner, attr = _name(child.func)
                risky = attr in UNPICKLING and (attr not in {"load", "loads"} or owner == "pickle")
                if attr == "load" and owner == "torch":
                    risky = not _safe_torch_load(child)
                if risky and (rel, inner) not in ALLOWED and (rel, function) not in ALLOWED:
                    found.append(f"{rel}:{child.lineno} {owner}.{attr} in {inner}()")
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_no_internal_path_unpickles_what_peers_or_files_send():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        found += _violations(ast.parse(path.read_text(encoding="utf-8")), rel)
    assert found == [], "unpickling on an internal path (use rankwise.comm.wire):\n" + "\n".join(found)


def test_the_scan_catches_each_form():
    code = (
        "def f(dist, pickle, torch, b):\n"
        "    dist.all_gather_object([None], 1)\n"
        "    dist.broadcast_object_list([1])\n"
        "    pickle.loads(b)\n"
        "    torch.load(b)\n"
        "    torch.load(b, weights_only=False)\n"
        "    torch.load(b, weights_only=True)\n"
    )
    found = _violations(ast.parse(code), "x.py")
    assert [f.split()[1] for f in found] == [
        "dist.all_gather_object",
        "dist.broadcast_object_list",
        "pickle.loads",
        "torch.load",
        "torch.load",
    ]


def test_the_allow_list_names_functions_that_exist():
    # A renamed function must not leave a stale exemption behind.
    for rel, function in ALLOWED:
        tree = ast.parse((SRC / rel).read_text(encoding="utf-8"))
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in names, (rel, function)
