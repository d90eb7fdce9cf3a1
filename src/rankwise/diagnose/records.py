"""What a diagnosis is made of: a call site, one rank's record of a collective, one rank's view,
and how one record is described ("all_reduce #57 (bucket 3, float32[1024], from train.py:42,
inside `if rank == 0`)").

Pure (no torch.distributed), so the wording is unit-tested without processes.
"""

from __future__ import annotations

import ast
import os
import stat
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple


class Site(NamedTuple):
    """A place in the user's code (a tuple: made on every collective, so it must be cheap)."""

    file: str
    line: int
    func: str

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@dataclass(frozen=True)
class Record:
    """One collective as one rank saw it."""

    seq: int
    op: str
    sig: str
    """Operation details and tensor signature, e.g. 'sum, float32[1024]'."""
    label: str | None
    site: Site | None
    state: str
    """'entered' (published before issuing), 'waiting', 'done' or 'failed'."""
    digest: int


@dataclass(frozen=True)
class RankView:
    """What the side channel says about one rank."""

    rank: int
    latest: Record | None
    alive: bool | None
    """False: no heartbeat for a while (killed, crashed or frozen); None: never reported."""
    silent_s: float | None = None
    """Seconds since its last heartbeat."""
    frame: Site | None = None
    """Where its main thread was at its last heartbeat (user code); for a finished rank, where
    it called ``rw.shutdown`` (None at a clean exit); for a rank that raised, the user's line
    the exception came from."""
    finished: bool = False
    """It ended normally (``rw.shutdown`` or a clean exit): it will issue no more collectives."""
    raised: str | None = None
    """It ended on an exception: 'ValueError: bad batch' (escaped, shortened)."""
    node: int | None = None
    """Its node (machine) index, from its heartbeat; None when unknown."""


LOCAL_FILES: set[str] = set()
"""Files this rank has seen in its own stack (its call sites, its main thread's frames): the
only files a report quotes. A peer's record names a file too, but a peer may name anything
(/dev/zero, a FIFO, a secret): those names are printed, never opened."""

MAX_SOURCE_BYTES = 4 << 20
"""A source file larger than this is not parsed for the ``if`` around a call site."""


def _read_source(path: str) -> str | None:
    """The text of ``path`` when it is a regular file of at most ``MAX_SOURCE_BYTES``."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)  # of what was opened, not of what the name pointed to before
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SOURCE_BYTES:
            return None
        data = os.read(fd, MAX_SOURCE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if len(data) > MAX_SOURCE_BYTES else data.decode("utf-8", "replace")


@lru_cache(maxsize=64)
def _parsed(path: str, mtime: float) -> tuple[ast.AST, str] | None:
    source = _read_source(path)
    if source is None:
        return None
    try:
        return ast.parse(source), source
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def if_context(path: str, line: int) -> str | None:
    """The innermost ``if`` around ``line`` in ``path``: "inside `if rank == 0`" (best effort).

    Only for a file this rank has seen in its own stack (``LOCAL_FILES``); any other name
    (a peer's) gives None without being opened.
    """
    if path not in LOCAL_FILES:
        return None
    try:
        parsed = _parsed(path, os.stat(path).st_mtime)
    except OSError:
        return None
    if parsed is None:
        return None
    tree, source = parsed
    best: tuple[int, str] | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        for branch, inside in ((node.body, "inside"), (node.orelse, "in the else of")):
            if branch and branch[0].lineno <= line <= (branch[-1].end_lineno or line):
                depth = branch[0].lineno  # the innermost branch starts last
                if best is None or depth >= best[0]:
                    test = ast.get_source_segment(source, node.test) or ast.unparse(node.test)
                    test = test if len(test) <= 60 else test[:57] + "..."
                    best = (depth, f"{inside} `if {test}`")
    return None if best is None else best[1]


def describe(rec: Record, *, context: bool = True) -> str:
    """'all_reduce #57 (bucket 3, float32[1024], from train.py:42, inside `if rank == 0`)'."""
    details = [part for part in (rec.label, rec.sig) if part]
    if rec.site is not None:
        details.append(f"from {rec.site.short()}")
        where = if_context(rec.site.file, rec.site.line) if context else None
        if where:
            details.append(where)
    return f"{rec.op} #{rec.seq}" + (f" ({', '.join(details)})" if details else "")
