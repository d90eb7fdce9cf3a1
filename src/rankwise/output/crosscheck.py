"""Numbers printed on rank 0 compared with the other ranks' (``rt.print``, ``rt.log``).

``rt.print`` speaks on rank 0 only, so a per-rank number (an accuracy from ``.item()`` on each
rank's shard) is printed as if it were the job's. Every rank that calls ``rt.print`` or
``rt.log`` therefore publishes the numbers it would have printed, and rank 0 compares: when
they differ, its line says "rank 0's value; ranks differ: mean X".

The comparison goes through the rendezvous store, the side channel the diagnosis already uses
(``rankwise.diagnose.channel``), never through a collective: ``if rt.rank == 0: rt.print(...)``
is common, and a collective there would hang. Other ranks only write (one store ``set``, no
reply awaited); rank 0 waits a bounded time for their values at each call site, and at a site
where they never came (rank 0 prints alone) it stops waiting. Values that arrive after rank 0
printed are compared later (at its next print, or at ``rw.shutdown()``) and the earlier line is
named. What peers publish is JSON (a list of numbers), read as untrusted data: never unpickled.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import time
import zlib
from datetime import timedelta
from typing import Any

from .. import runtime

WAIT_S = 1.0
"""Seconds rank 0 waits for the other ranks' numbers the first time a call site prints."""
_PREFIX = "rankwise/print"
_MAX_NUMBERS = 64  # a line with more numbers than this is not a metric line: not compared
_MAX_PENDING = 64
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])")


class _State:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.alone: set[str] = set()  # sites where the other ranks did not publish in time
        self.pending: list[tuple[str, list[str], list[float], str, list[str] | None]] = []
        self.hooked = False


STATE = _State()


def numbers(text: str) -> tuple[list[str], str]:
    """The numbers written in ``text`` (as written) and the text with each replaced by '#'."""
    found = _NUMBER.findall(text)
    return found, _NUMBER.sub("#", text)


def _store_and_coords() -> tuple[Any, int, int] | None:
    if not runtime.is_initialized():
        return None
    c = runtime.coords()
    if c.world_size < 2:
        return None
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store(), c.rank, c.world_size
    except Exception:
        return None


def _site(kind: str) -> str:
    """'kind:<crc of file:line>:<n>', the n-th call from the user's line (same on every rank)."""
    frame = sys._getframe(2)
    ours = __file__.rsplit("output", 1)[0]
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame = frame.f_back
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?"
    site = f"{kind}:{zlib.crc32(where.encode()):08x}"
    n = STATE.calls.get(site, 0)
    STATE.calls[site] = n + 1
    return f"{site}:{n}"


def _key(site: str, rank: int) -> str:
    return f"{_PREFIX}/{site}/{rank}"


def _parse(raw: bytes, count: int) -> list[float] | None:
    """A peer's published numbers: a JSON list of ``count`` numbers, else None (untrusted)."""
    try:
        values = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(values, list) or len(values) != count:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return [float(v) for v in values]


def _collect(store: Any, site: str, world: int, count: int, wait: float) -> list[list[float]] | None:
    """The other ranks' numbers for ``site`` (removed from the store), or None while missing."""
    keys = [_key(site, r) for r in range(1, world)]
    try:
        if wait > 0:
            store.wait(keys, timedelta(seconds=wait))
        elif not store.check(keys):
            return None
    except Exception:
        return None
    peers = []
    for key in keys:
        parsed = _parse(store.get(key), count)
        store.delete_key(key)
        if parsed is None:
            return []
        peers.append(parsed)
    return peers


def _shown_like(token: str, value: float) -> str:
    """``value`` written with as many decimals as ``token`` has (``:g`` for a whole number)."""
    if "." in token and "e" not in token.lower():
        return f"{value:.{len(token.split('.')[1])}f}"
    return f"{value:.6g}"


def describe(
    tokens: list[str], mine: list[float], peers: list[list[float]], names: list[str] | None = None
) -> str | None:
    """'rank 0's value; ranks differ: mean X' for the numbers that differ, or None.
    ``names``: what each number is (``rt.log``'s metric names)."""
    differ = []
    for i, token in enumerate(tokens):
        column = [mine[i], *(p[i] for p in peers)]
        if any(v != mine[i] and not (math.isnan(v) and math.isnan(mine[i])) for v in column):
            mean = sum(column) / len(column)
            differ.append((i, token, f"{mean:.6g}" if names else _shown_like(token, mean)))
    if not differ:
        return None
    if names is not None:
        return "; ".join(f"{names[i]}={t} is rank 0's value; ranks differ: mean {m}"
                         for i, t, m in differ)  # fmt: skip
    if len(differ) == 1:
        which = f"{differ[0][1]}: " if len(tokens) > 1 else ""
        return f"{which}rank 0's value; ranks differ: mean {differ[0][2]}"
    parts = ", ".join(f"{t} -> mean {m}" for _, t, m in differ)
    return f"rank 0's values; ranks differ: {parts}"


def _floats(tokens: list[str]) -> list[float]:
    return [float(t) for t in tokens]


def compare(
    kind: str, text: str, tokens: list[str] | None = None, names: list[str] | None = None
) -> str | None:
    """Publish (other ranks) or compare (rank 0) the numbers of ``text`` (or ``tokens``),
    printed at the caller's line. On rank 0 returns the note to append to the line, or None.
    Never a sync point: other ranks write to the store and go on; rank 0 waits at most
    ``WAIT_S`` (and no more at a call site where the other ranks never published)."""
    tokens = numbers(text)[0] if tokens is None else tokens
    if not tokens or len(tokens) > _MAX_NUMBERS:
        return None
    where = _store_and_coords()
    if where is None:
        return None
    store, rank, world = where
    site = _site(kind)
    try:
        return _exchange(store, (rank, world), site, tokens, text, names)
    except Exception:  # the store is gone (shutdown, a lost host): printing goes on
        return None


def _exchange(
    store: Any, where: tuple[int, int], site: str, tokens: list[str], text: str,
    names: list[str] | None,
) -> str | None:  # fmt: skip
    rank, world = where
    mine = _floats(tokens)
    if rank != 0:
        store.set(_key(site, rank), json.dumps(mine))
        return None
    late_notes(store, world)
    line = site.rsplit(":", 1)[0]
    wait = 0.0 if line in STATE.alone else WAIT_S
    peers = _collect(store, site, world, len(tokens), wait)
    if peers is None:
        STATE.alone.add(line)
        if len(STATE.pending) < _MAX_PENDING:
            STATE.pending.append((site, tokens, mine, text, names))
        _hook_shutdown()
        return None
    STATE.alone.discard(line)
    return describe(tokens, mine, peers, names) if peers else None


def late_notes(store: Any = None, world: int = 0, wait: float = 0.0) -> list[str]:
    """Rank 0: compare the lines whose peers' numbers came after the line was printed; print
    (and return) one note per line that differed. ``wait``: seconds to wait, in all."""
    if not STATE.pending:
        return []
    if store is None:
        where = _store_and_coords()
        if where is None:
            return []
        store, _, world = where
    notes, still = [], []
    deadline = time.monotonic() + wait
    for entry in STATE.pending:
        site, tokens, mine, text, names = entry
        left = max(0.0, deadline - time.monotonic())
        peers = _collect(store, site, world, len(tokens), left)
        if peers is None:
            still.append(entry)
            continue
        note = describe(tokens, mine, peers, names) if peers else None
        if note is not None:
            notes.append(f"rankwise: the line {text.strip()[:120]!r} printed earlier: {note}")
    STATE.pending = still
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    return notes


def _hook_shutdown() -> None:
    if not STATE.hooked:
        STATE.hooked = True
        runtime.on_shutdown(_at_shutdown, first=True)


def _at_shutdown() -> None:
    with contextlib.suppress(Exception):  # the store may be gone already
        late_notes(wait=WAIT_S)
    STATE.pending.clear()
