"""What the launcher says while it waits, and how the workers' output reaches the console.

Workers' lines are read from their log files by torch's agent (``tee``) and written to the
launcher's console with the ``[rankN]: `` prefix. ``--no-prefix`` without ``--log-dir`` lets the
workers write to the console directly (a terminal keeps their progress bars live);
``--no-prefix --log-dir DIR`` keeps the files and strips the prefix from the console copy.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, TextIO

from .options import RANK_PREFIX, LaunchOptions, Rendezvous

_PREFIX = re.compile(re.escape(RANK_PREFIX).replace(re.escape("${rank}"), r"\d+"))


class _Unprefixed:
    """A console stream that drops the rank prefix at the start of each line torch writes."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(_PREFIX.sub("", text, count=1) if _PREFIX.match(text) else text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def console(opts: LaunchOptions) -> Iterator[None]:
    """While the job runs: the console copy of the workers' lines, prefixed or not."""
    if opts.prefix_output or not opts.log_dir:
        yield
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Unprefixed(sys.stdout), _Unprefixed(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def tee_to_files(opts: LaunchOptions) -> bool:
    """Whether workers write to log files that torch copies to the console (else: directly)."""
    return opts.prefix_output or bool(opts.log_dir)


def _nodes(first: int, last: int) -> str:
    if first == last:
        return f"node {first}"
    return f"nodes {first}-{last}" if last > first + 1 else f"nodes {first} and {last}"


def waiting_message(opts: LaunchOptions, rdzv: Rendezvous, now: datetime | None = None) -> str:
    """Who this node waits for, where, and until when ('' on one node: nobody to wait for)."""
    if opts.nnodes == 1 and opts.min_nodes in (None, 1):
        return ""
    now = now or datetime.now(timezone.utc)
    until = (now + timedelta(seconds=opts.rdzv_timeout)).strftime("%H:%M:%S UTC")
    deadline = f"until {until} (--rdzv-timeout {opts.rdzv_timeout}s)"
    if rdzv.backend == "static":
        me = f"node {opts.node_rank} of {opts.nnodes}"
        if opts.node_rank == 0:
            who = _nodes(1, opts.nnodes - 1)
            where = f"this node's rendezvous at {rdzv.endpoint}"
        else:
            who = "node 0" + (" and the other nodes" if opts.nnodes > 2 else "")
            where = f"{rdzv.endpoint} (node 0's --master-addr/--master-port)"
        return f"rankwise run: {me}: waiting for {who} to join at {where}, {deadline}"
    count = opts.nnodes if opts.min_nodes is None else f"{opts.min_nodes} to {opts.nnodes}"
    return (
        f"rankwise run: waiting for {count} nodes to join rendezvous {rdzv.run_id!r} "
        f"({rdzv.backend}) at {rdzv.endpoint}, {deadline}"
    )


class RankLines:
    """rw.launch's workers' output here: ``[rank r] `` before each line, and a worker's bar
    (its ``\\r`` updates, sent as ``bar``) kept on one line, redrawn in place when ``live`` (a
    terminal or a notebook), other lines printed above it; elsewhere only its final state."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self.bar: tuple[int, str, str] | None = None  # (rank, stream, text) of the open bar
        self.drawn = 0  # characters of the bar on screen (0: none drawn)

    @staticmethod
    def _out(stream: str) -> TextIO:
        return sys.stderr if stream == "stderr" else sys.stdout

    def _draw(self) -> None:
        if self.live and self.bar is not None:
            rank, stream, text = self.bar
            shown = f"[rank {rank}] {text}"
            pad = " " * max(self.drawn - len(shown), 0)  # what the longer old text leaves
            self._out(stream).write("\r" + shown + pad)
            self._out(stream).flush()
            self.drawn = len(shown)

    def _erase(self) -> None:
        if self.drawn and self.bar is not None:
            out = self._out(self.bar[1])
            out.write("\r" + " " * self.drawn + "\r")
            out.flush()
        self.drawn = 0

    def bar_update(self, rank: int, stream: str, text: str) -> None:
        """A worker redrew its bar (``text``; empty: it cleared it)."""
        if not text or (self.bar is not None and self.bar[:2] != (rank, stream)):
            self._erase()  # one bar line at a time: the newest one is drawn
        self.bar = (rank, stream, text) if text else None
        self._draw()

    def line(self, rank: int, stream: str, text: str) -> None:
        """A whole line from a worker. An empty one from the bar's own stream ends the bar:
        its last state stays on screen, as it does in a terminal."""
        text = next((s for s in reversed(text.split("\r")) if s.strip()), "").rstrip()
        if self.bar is not None and self.bar[:2] == (rank, stream) and not text:
            self.end()
            return
        self._erase()
        print(f"[rank {rank}] {text}", file=self._out(stream), flush=True)
        self._draw()

    def end(self) -> None:
        """The open bar (if any) keeps its last state as a line of its own."""
        if self.bar is not None:
            rank, stream, text = self.bar
            out = self._out(stream)
            if self.live:
                self._draw()
                out.write("\n")
            else:
                out.write(f"[rank {rank}] {text}\n")
            out.flush()
        self.bar, self.drawn = None, 0
