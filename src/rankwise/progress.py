"""``rw.progress(loader)``: one progress bar for the whole job, on rank 0, in global samples/s."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from . import comm
from .log import open_bars

T = TypeVar("T")


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (nested tuples/dicts too)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = _batch_len(item)
            if n:
                return n
    return 0


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


class _Counted:
    """Yields from ``iterable`` and updates a tqdm bar with global samples/s."""

    def __init__(self, iterable: Iterable[T], bar: Any, replicas: int, lines: bool) -> None:
        self.iterable, self.bar, self.replicas = iterable, bar, replicas
        self.lines = lines  # the bar writes whole lines (_LineFile), not in place

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        start, samples = time.perf_counter(), 0
        if not self.lines:
            open_bars.add(self.bar)
        try:
            for batch in self.iterable:
                yield batch
                samples += _batch_len(batch) * self.replicas
                elapsed = max(time.perf_counter() - start, 1e-9)
                self.bar.set_postfix_str(
                    f"{samples / elapsed:,.0f} samples/s (global)", refresh=False
                )
                self.bar.update(1)
        finally:
            open_bars.discard(self.bar)
            if self.lines:  # one final line, with the final count: not a second one at close
                if self.bar.last_print_n != self.bar.n:
                    self.bar.refresh()
                self.bar.leave = False
            self.bar.close()


def progress(
    iterable: Iterable[T],
    *,
    desc: str | None = None,
    total: int | None = None,
    replicas: int | None = None,
    **tqdm_kwargs: Any,
) -> Iterable[T]:
    """Iterate ``iterable``; on rank 0 show a tqdm bar with the job's global samples/s.

    Other ranks get the iterable back untouched (no bar, no output). ``replicas`` is how many
    processes each see a batch of that size (the world size, the default, for DDP; 1 when the
    batch is already global, as with DataParallel).
    """
    if comm.rank() != 0:
        return iterable
    from tqdm.auto import tqdm

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if not sys.stderr.isatty() and "file" not in tqdm_kwargs:
        # Under a launcher each refresh becomes a log line: one every few seconds, the first
        # after a second (a short pass gets one line, its last). On stdout, in order with
        # the script's prints (a launcher reads stdout and stderr separately).
        tqdm_kwargs["file"] = _LineFile(sys.stdout)
        tqdm_kwargs.setdefault("delay", 1.0)
        tqdm_kwargs.setdefault("mininterval", 2.0)
    bar = tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, **tqdm_kwargs)
    replicas = comm.world_size() if replicas is None else replicas
    return _Counted(iterable, bar, replicas, isinstance(tqdm_kwargs.get("file"), _LineFile))
