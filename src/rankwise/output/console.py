"""Where this process's output is shown: a Jupyter kernel, a terminal, or a file/pipe.

Progress bars are drawn differently in each (a widget, a line redrawn with ``\\r``, whole
lines), and ``rw.launch`` asks the same question of its caller before it decides whether its
workers may send ``\\r`` updates (docs/launcher.md).
"""

from __future__ import annotations

import sys
import unicodedata
from typing import Any

_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs"})


def printable(text: str, limit: int | None = None) -> str:
    """``text`` safe to show on a console: control and format characters escaped (``\\x1b``,
    ``\\u202e``), and at most ``limit`` characters (the rest replaced by ``...``).

    For what another process sent (a peer's error text, its call site, a heartbeat): a terminal
    escape could rewrite the screen, a bidi control could reorder what the reader sees, and a
    megabyte of text would bury the message it is quoted in.
    """
    if not isinstance(text, str):
        text = str(text)
    if limit is not None and len(text) > limit:
        text = text[: max(0, limit - 3)] + "..."
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(
        ch if unicodedata.category(ch) not in _UNSAFE else ch.encode("unicode_escape").decode()
        for ch in text
    )


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython's ``ZMQInteractiveShell`` or an ``IPKernelApp``).

    Only looks at an IPython that is already imported: a plain script never imports it.
    A process forked from a kernel (``rw.launch``) also answers True; its output is forwarded,
    which the caller checks first (``env.launcher_prefixes_output``).
    """
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    if shell is None:
        return False
    if type(shell).__name__ == "ZMQInteractiveShell":
        return True
    try:
        return "IPKernelApp" in shell.config
    except Exception:
        return False


def notebook_bar_class() -> Any:
    """tqdm's widget bar when ipywidgets imports, else None (without tqdm's TqdmWarning)."""
    try:
        import ipywidgets  # noqa: F401  (tqdm.notebook needs it to draw)
        from tqdm import notebook
    except ImportError:
        return None
    return notebook.tqdm if getattr(notebook, "IProgress", None) is not None else None


def redraws_in_place(stream: Any) -> bool:
    """Whether text written to ``stream`` may rewrite its last line with ``\\r``: a terminal,
    or a notebook's output cell (which applies ``\\r`` as a terminal does)."""
    try:
        if stream.isatty():
            return True
    except Exception:
        pass
    return in_notebook()
