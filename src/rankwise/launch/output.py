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
from typing import Any

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
