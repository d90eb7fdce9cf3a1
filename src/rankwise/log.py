"""Rank-aware output: the replicas are identical, so by default only rank 0 speaks."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from .runtime import coords


def _coords() -> tuple[int, int]:
    c = coords()
    return c.rank, c.world_size


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (flushed, so it is not lost when a run is killed)."""
    if _coords()[0] == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


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
    handler = logging.StreamHandler(sys.stderr)
    handler._rankwise = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("[rank %(rank)d/%(world_size)d] %(message)s"))
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
