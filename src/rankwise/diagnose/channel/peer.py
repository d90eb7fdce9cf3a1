"""What other ranks wrote to the side channel, read as untrusted data.

Any process that reaches the rendezvous store can write the diagnosis keys (docs/launcher.md:
the store is not authenticated), and a rank that is not ours may run next to ours. So a peer's
heartbeat, record or exit note is parsed here and nowhere else: sizes and JSON nesting are
capped before parsing, every field is type-checked, every string is escaped (``printable``)
and shortened before it can reach a terminal, and a value that does not fit is dropped (the
peer then counts as "never reported") instead of raising on the rank that reads it.

A peer's call site is only a name: this rank never opens a file a peer names
(``report.if_context`` reads only files this rank saw in its own stack).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ...output.console import printable
from ..report import Record, Site

MAX_JSON_CHARS = 1 << 20
"""The largest value read from the store (a ring of 256 records is ~80 KiB)."""
MAX_DEPTH = 8
"""The deepest JSON nesting a rankwise value has (a heartbeat is 4 deep)."""
TEXT_LIMIT = 300
"""Characters kept of any one peer string (an exception message, a path, a label)."""
STATES = frozenset({"entered", "waiting", "done", "failed"})

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"')  # possessive: linear on any input
_INNERMOST = re.compile(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")


def too_deep(raw: str, depth: int = MAX_DEPTH) -> bool:
    """True when the JSON text ``raw`` nests deeper than ``depth`` (or its brackets do not
    pair): checked at C speed, by removing the innermost brackets ``depth`` times."""
    text = _STRING.sub("", raw)
    for _ in range(depth):
        text, removed = _INNERMOST.subn("", text)
        if not removed:
            break
    return any(c in text for c in "[]{}")


def loads(raw: str | None, limit: int = MAX_JSON_CHARS) -> Any:
    """A peer's JSON value, or None when it is missing, too large, too deep or malformed."""
    if raw is None or len(raw) > limit or too_deep(raw):
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def text(value: Any, limit: int = TEXT_LIMIT) -> str | None:
    """A peer's string, escaped and shortened; None when it is not a string."""
    return printable(value, limit) if isinstance(value, str) else None


def integer(value: Any) -> int | None:
    """A peer's integer (not a bool, not a float), or None."""
    return value if type(value) is int else None


def number(value: Any) -> float | None:
    """A peer's time stamp or duration (int or float, finite), or None."""
    if type(value) not in (int, float) or value != value or abs(value) == float("inf"):
        return None
    return float(value)


def site(value: Any) -> Site | None:
    """``[file, line, func]`` from a peer, or None."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        return None
    file, line, func = text(value[0]), integer(value[1]), text(value[2], 100)
    if file is None or line is None or func is None:
        return None
    return Site(file, line, func)


def record(d: Any) -> Record | None:
    """One entry of a peer's heartbeat or ring (``Entry.to_dict``), or None when malformed."""
    if not isinstance(d, dict):
        return None
    seq, digest = integer(d.get("seq")), integer(d.get("digest"))
    op, sig = text(d.get("op"), 64), text(d.get("sig"))
    label = d.get("label")
    label = None if label is None else text(label, 100)
    state = d.get("state") if d.get("state") in STATES else None
    where = None if d.get("site") is None else site(d.get("site"))
    if None in (seq, digest, op, sig, state) or (d.get("site") is not None and where is None):
        return None
    return Record(seq, op, sig, label or None, where, state, digest)


def records(values: Any) -> list[Record]:
    """The well-formed records of a list (others are dropped)."""
    if not isinstance(values, list):
        return []
    return [rec for rec in map(record, values) if rec is not None]


SEP = "\x1f"


def parse_wire(raw: str | None) -> tuple[Record, float] | None:
    """The line a peer published before a collective (``sidechannel.wire``), or None."""
    if raw is None or len(raw) > 4096:
        return None
    parts = raw.split(SEP)
    if len(parts) != 9:
        return None
    seq, op, sig, label, file, line, func, digest, t = parts
    try:
        seq_n, line_n, digest_n, t_f = int(seq), int(line), int(digest), float(t)
    except ValueError:
        return None
    where = Site(printable(file, TEXT_LIMIT), line_n, printable(func, 100)) if file else None
    label_s = printable(label, 100) or None
    rec = Record(seq_n, printable(op, 64), printable(sig, TEXT_LIMIT), label_s, where,
                 "entered", digest_n)  # fmt: skip
    return rec, t_f


def exit_note(value: Any) -> dict[str, Any] | None:
    """A peer's note that it ended (finished, or raised): ``site`` and ``error`` checked."""
    if not isinstance(value, dict):
        return None
    note: dict[str, Any] = {"t": number(value.get("t")), "site": site(value.get("site"))}
    if "error" in value:
        error = text(value.get("error"), 500)
        if error is None:
            return None
        note["error"] = error
    return note


def heartbeat(value: Any) -> dict[str, Any] | None:
    """A peer's heartbeat (``sidechannel.Watchdog.beat``), every field checked: ``t``,
    ``frame`` (a Site or None), ``raw`` ([op, file, line, func, since] or None), ``blocked``
    ([what, since] or None: waiting on a pipeline transfer) and ``groups``
    (group name -> its latest records) and ``node`` (an int or None). None when it is not a heartbeat at all."""
    if not isinstance(value, dict):
        return None
    t = number(value.get("t"))
    if t is None:
        return None
    groups = value.get("groups")
    groups = groups if isinstance(groups, dict) else {}
    named = {name: records(entries) for name, entries in groups.items() if isinstance(name, str)}
    node = value.get("node")  # the peer's node (machine) index: a whole node lost is named
    return {
        "t": t,
        "frame": site(value.get("frame")),
        "raw": _raw(value.get("raw")),
        "blocked": _blocked(value.get("blocked")),
        "groups": named,
        "node": node if isinstance(node, int) and not isinstance(node, bool) else None,
    }


def _blocked(value: Any) -> list | None:
    """``[what, since]``: the peer waits on a transfer that is no collective (or None)."""
    if not isinstance(value, list) or len(value) != 2:
        return None
    what, since = text(value[0], 200), number(value[1])
    return None if what is None or since is None else [what, since]


def _raw(value: Any) -> list | None:
    if not isinstance(value, list) or len(value) != 5:
        return None
    op, where, since = text(value[0], 64), site(value[1:4]), number(value[4])
    if op is None or where is None or since is None:
        return None
    return [op, where.file, where.line, where.func, since]
