"""The public namespace: every exported name resolves, and importing rankwise stays cheap."""

from __future__ import annotations

import subprocess
import sys

import rankwise as rw


def test_every_exported_name_resolves():
    missing = [name for name in rw.__all__ if getattr(rw, name, None) is None]
    assert missing == []
    assert len(rw.__all__) == len(set(rw.__all__))


def test_cli_commands_that_need_no_torch_do_not_import_it():
    probe = "import sys, rankwise.cli; rankwise.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_public_names_are_listed_the_same_three_times():
    """``_LAZY`` (what runs), the ``TYPE_CHECKING`` imports (what IDEs see) and ``__all__``
    (what ``import *`` and linters see) name the same public names, from the same modules."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(rw.__file__).read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                for alias in imp.names:
                    typed[alias.name] = "." + (imp.module or alias.name)
    assert typed == rw._LAZY
    assert sorted(rw.__all__) == sorted([*rw._LAZY, "__version__"])
