"""Rank-aware output: the replicas are identical, so by default only rank 0 speaks."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from .. import validate
from ..job import env as envmod
from ..runtime import coords
from . import console, crosscheck


def _coords() -> tuple[int, int]:
    c = coords()
    return c.rank, c.world_size


open_bars: set[Any] = set()
"""Progress bars drawn in place on a terminal (``rw.progress``), which a print must not cut."""


def write(*args: Any, sep: str = " ", end: str = "\n", file: Any = None, flush: bool = True) -> None:
    """``print``, through the open progress bar (``tqdm.write``): the text lands above the bar."""
    file = sys.stdout if file is None else file
    if open_bars:
        from tqdm.std import tqdm  # tqdm.auto warns in a notebook without ipywidgets

        tqdm.write(sep.join(str(a) for a in args), file=file, end=end)
        if flush:
            file.flush()
    else:
        print(*args, sep=sep, end=end, file=file, flush=flush)


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (flushed, so it is not lost when a run is killed).

    Called on every rank, the numbers in the line are compared with the other ranks' through
    the side channel (``crosscheck``, never a collective: calling it on rank 0 alone is fine):
    where they differ the line ends with "(rank 0's value; ranks differ: mean X)".
    ``ranks_agree=False`` skips that for numbers that differ by nature (a rank's own time).
    """
    compare = kwargs.pop("ranks_agree", True)
    sep = " " if kwargs.get("sep") is None else kwargs["sep"]
    text = sep.join(str(a) for a in args) if compare else ""
    note = crosscheck.compare("print", text) if compare else None
    if _coords()[0] == 0:
        kwargs.setdefault("flush", True)
        if note is not None:
            args, kwargs["sep"] = (f"{text} ({note})",), sep
        write(*args, **kwargs)  # through an open progress bar, never into it


class _ThroughBar(logging.StreamHandler):
    """A console handler whose lines go above an open progress bar instead of into it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank, self.world, self.all_ranks = rank, world, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        record.world_size = self.world
        # Warnings and errors from any rank matter; routine messages only from rank 0.
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


def _check_logger_arguments(name: Any, level: Any, log_dir: Any) -> None:
    """``get_logger``'s arguments as ``logging`` reads them (None: the root logger; a level's
    name such as 'INFO' or a number), by type (``rankwise.validate``)."""
    validate.text("name", name, optional=True, where="rw.get_logger()")
    known = logging.getLevelNamesMapping()
    if not (validate.is_int(level) or (isinstance(level, str) and level in known)):
        validate.fail("level", level, f"a logging level: a number or one of {', '.join(known)}",
                      where="rw.get_logger()", fix="pass e.g. level=logging.INFO or 'DEBUG'.")
    validate.path("log_dir", log_dir, optional=True, where="rw.get_logger()")


def get_logger(
    name: str = "rankwise",
    *,
    level: int = logging.INFO,
    all_ranks: bool = False,
    log_dir: str | os.PathLike | None = None,
) -> logging.Logger:
    """A logger whose lines start with ``[rank r/w]``; non-zero ranks only log warnings and up.

    ``all_ranks=True`` lets every rank log at ``level`` to the console (for debugging one
    rank's behaviour). ``log_dir`` additionally gives every rank its own complete file,
    ``log_dir/rank<r>.log``, so nothing is lost and nothing interleaves.
    """
    _check_logger_arguments(name, level, log_dir)
    rank, world = _coords()
    logger = logging.getLogger(name)
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):
        if getattr(h, "_rankwise", False):
            logger.removeHandler(h)
    handler = _ThroughBar(sys.stderr)
    handler._rankwise = True  # type: ignore[attr-defined]
    # Under `rankwise run` every line already starts with the launcher's `[rank0]: `.
    prefix = "" if envmod.launcher_prefixes_output() else "[rank %(rank)d/%(world_size)d] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    handler.addFilter(_RankFilter(rank, world, all_ranks))
    logger.addHandler(handler)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
        to_file._rankwise = True  # type: ignore[attr-defined]
        to_file.setFormatter(
            logging.Formatter("%(asctime)s [rank %(rank)d/%(world_size)d] %(message)s")
        )
        to_file.addFilter(_RankFilter(rank, world, all_ranks=True))
        logger.addHandler(to_file)
    return logger


class _LineFile:
    """A bar's output as whole lines: each refresh one line, none repeated, no carriage return.

    A launcher (``rankwise run``, torchrun) reads worker output line by line and prefixes each
    line with the rank: a bar redrawn in place with ``\\r`` becomes broken and blank lines there.
    """

    def __init__(self, stream: Any) -> None:
        self.stream, self.last = stream, ""
        self.encoding = getattr(stream, "encoding", None)  # tqdm draws unicode blocks if it can

    def write(self, text: str) -> int:
        for piece in text.replace("\r", "\n").split("\n"):
            piece = piece.rstrip()
            if piece and piece != self.last:
                self.last = piece
                self.stream.write(piece + "\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def finish_bar(bar: Any, lines: bool) -> None:
    """Close ``bar``; as lines, end on one line with the final count (not a second at close)."""
    if lines and not bar.disable:  # a disabled bar (tqdm's disable=True) never printed
        if bar.last_print_n != bar.n:
            bar.refresh()
        bar.leave = False
    bar.close()


def _bar_kind(own_file: bool) -> str:
    """How a bar is drawn here (docs/logging.md): "widget" (a notebook with ipywidgets),
    "text" (a line on the bar's stream redrawn with \\r: a notebook without ipywidgets, or
    rw.launch's caller redraws it), "terminal" (tqdm's own, in place), or "lines" (whole
    lines, for launchers and files)."""
    if own_file:
        return "terminal"  # the caller's stream: tqdm writes to it in place
    if envmod.parent_draws_bars():
        return "text"  # rw.launch's caller redraws our \\r updates as one line
    if not envmod.launcher_prefixes_output() and console.in_notebook():
        # A forked rw.launch worker also sees the kernel; its output is forwarded (above).
        return "widget" if console.notebook_bar_class() is not None else "text"
    return "terminal" if sys.stderr.isatty() else "lines"


def make_bar(total: int | None, desc: str | None, unit: str, lines_to: Any, kw: dict) -> Any:
    """A tqdm bar on ``lines_to`` (or ``kw["file"]``), and whether it writes whole lines."""
    from tqdm.std import tqdm

    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock holds a multiprocessing semaphore, which a spawned rank (as in
        # rankwise bench) then "leaks" at exit; one process draws its bars: a thread lock does.
        tqdm.set_lock(threading.RLock())
    kind = _bar_kind("file" in kw)
    if kind == "widget":
        return console.notebook_bar_class()(total=total, desc=desc, unit=unit, **kw), False
    if kind == "lines":
        # Under a launcher each refresh becomes a log line: one every few seconds, the first
        # after a second (a short pass gets one line, its last). rw.progress writes them on
        # stdout, in order with the script's prints (a launcher reads the two separately).
        kw["file"] = _LineFile(lines_to)
        kw.setdefault("delay", 1.0)
        kw.setdefault("mininterval", 2.0)
    elif kind == "text":
        kw["file"] = lines_to  # stdout for rw.progress: in order with the prints
    if envmod.parent_draws_bars():
        kw.setdefault("mininterval", 0.5)  # each redraw crosses a process boundary
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, **kw), kind == "lines"


class TaskBar:
    """Progress over units of work (``task_bar``); shows nothing when ``bar`` is None."""

    def __init__(self, bar: Any = None, lines: bool = False) -> None:
        self.bar, self.lines = bar, lines
        if bar is not None and not lines:
            open_bars.add(bar)

    def update(self, doing: str = "", n: int = 1) -> None:
        """``n`` more units done; ``doing`` says what runs now."""
        if self.bar is not None:
            self.bar.set_postfix_str(doing, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            open_bars.discard(self.bar)
            finish_bar(self.bar, self.lines)
            self.bar = None


def task_bar(total: int, desc: str, *, unit: str = "task", file: Any = None) -> TaskBar:
    """A bar over ``total`` units of work on rank 0 (elsewhere one that shows nothing).

    Same output rules as ``progress``; ``file`` (default stderr) is where it goes.
    """
    if _coords()[0] != 0:
        return TaskBar()
    stream = sys.stderr if file is None else file
    kw: dict[str, Any] = {} if stream is sys.stderr else {"file": stream}
    return TaskBar(*make_bar(total, desc, unit, stream, kw))
