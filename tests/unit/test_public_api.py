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
