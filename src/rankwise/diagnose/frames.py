"""Which stack frames are the user's: the call site a diagnosis names is the first frame outside
rankwise, torch and the standard library (a collective entered through a ``with`` block is the
user's ``with`` line, not ``contextlib.py``). Installed packages count as user code: a library
that calls rankwise (a trainer, a callback) is where the call came from.
"""

from __future__ import annotations

import os
import site as site_module
import sysconfig


def _folders(*paths: str | None) -> tuple[str, ...]:
    return tuple(sorted({os.path.join(p, "") for p in paths if p}))


STDLIB = _folders(*(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")))
"""The standard library's folders: contextlib, threading, runpy are never the user's line."""
PACKAGES = _folders(
    *site_module.getsitepackages(), site_module.getusersitepackages(),
    *(sysconfig.get_paths().get(k) for k in ("purelib", "platlib")),
)  # fmt: skip
"""Installed packages (inside the standard library's folder on most installs): user code."""


def internal(filename: str, skip: tuple[str, ...]) -> bool:
    """True for a frame that is not the user's: under ``skip`` (rankwise, torch, frozen
    modules) or in the standard library (a ``with`` block's ``contextlib.py``)."""
    if filename.startswith(skip):
        return True
    return filename.startswith(STDLIB) and not filename.startswith(PACKAGES)
