"""Rank-aware output: the replicas are identical, so by default only rank 0 speaks."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from . import env as envmod
from . import runtime


def _coords() -> tuple[int, int]:
    if runtime.is_initialized():
        rt = runtime.get_runtime()
        return rt.rank, rt.world_size
    e = envmod.detect()
    return e.rank, e.world_size


open_bars: set[Any] = set()
"""Progress bars drawn in place on a terminal (``rw.progress``), which a print must not cut."""


def write(*args: Any, sep: str = " ", end: str = "\n", file: Any = None, flush: bool = True) -> None:
    """``print``, through the open progress bar (``tqdm.write``): the text lands above the bar."""
    file = sys.stdout if file is None else file
    if open_bars:
        from tqdm.auto import tqdm

        tqdm.write(sep.join(str(a) for a in args), file=file, end=end)
        if flush:
            file.flush()
    else:
        print(*args, sep=sep, end=end, file=file, flush=flush)


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (flushed, so it is not lost when a run is killed)."""
    if _coords()[0] == 0:
        kwargs.setdefault("flush", True)
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
