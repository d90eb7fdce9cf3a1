"""Settings merged into the ``[tool.rankwise]`` table of a ``pyproject.toml``, line by line.

The file is the user's: everything outside the table, and every line of the table that does
not change, is kept as it is (comments, order, spacing). A setting already in the table gets
its value replaced on its own line; a new one is added after the table's last setting; one no
longer wanted is removed. The result is parsed again and must hold exactly the settings asked
for, or nothing is written (a table written in a shape this does not edit: inline, dotted keys,
values over several lines, is left to the user, with that said).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from ...errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_HEADER = re.compile(r"^\s*\[\s*tool\s*\.\s*rankwise\s*\]\s*(#.*)?$")
_ANY_HEADER = re.compile(r"^\s*\[")
_KEY = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")


def _table_span(lines: list[str]) -> tuple[int, int] | None:
    """(header line, end) of the ``[tool.rankwise]`` table, or None when it has no header."""
    start = next((i for i, line in enumerate(lines) if _HEADER.match(line)), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(lines)) if _ANY_HEADER.match(lines[i])), len(lines))
    return start, end


def merge(text: str, values: dict[str, Any], line_of: Callable[[str, Any], str]) -> str:
    """``text`` (a pyproject.toml with a ``[tool.rankwise]`` table) whose table holds exactly
    ``values`` (dash names); ``line_of(key, value)`` writes one ``key = value`` line."""
    lines = text.splitlines(keepends=True)
    span = _table_span(lines)
    if span is None:
        raise _refused("its [tool.rankwise] settings are not under a [tool.rankwise] header")
    start, end = span
    wanted = dict(values)
    body = []
    for i in range(start + 1, end):
        found = _KEY.match(lines[i])
        if found is None:  # comments, blank lines: kept
            body.append(lines[i])
        elif (key := found.group(1).replace("_", "-")) in wanted:
            body.append(line_of(found.group(1), wanted.pop(key)) + "\n")
        # else: a setting no longer wanted, dropped
    body = _insert_new(body, wanted, line_of)
    merged = "".join(lines[: start + 1] + body + lines[end:])
    if _read_back(merged) != values:
        raise _refused("a setting in its [tool.rankwise] table spans several lines or is inline")
    return merged


def _insert_new(body: list[str], new: dict[str, Any], line_of: Callable[[str, Any], str]) -> list[str]:
    """``new`` settings added after the table's last non-blank line (its trailing blank lines
    stay between the table and the next one)."""
    if not new:
        return body
    at = len(body)
    while at > 0 and not body[at - 1].strip():
        at -= 1
    if at > 0 and not body[at - 1].endswith("\n"):
        body[at - 1] += "\n"
    added = [line_of(k, v) + "\n" for k, v in new.items()]
    return body[:at] + added + body[at:]


def _read_back(text: str) -> dict[str, Any]:
    try:
        table = tomllib.loads(text).get("tool", {}).get("rankwise", {})
    except tomllib.TOMLDecodeError:
        return {"(not valid TOML)": True}
    return {str(k).replace("_", "-"): v for k, v in table.items()}


def _refused(why: str) -> ConfigError:
    return ConfigError(
        f"rankwise config cannot merge into pyproject.toml: {why}",
        fix="edit [tool.rankwise] in pyproject.toml by hand (one `key = value` line per "
        "setting), or pass --config rankwise.toml to write a separate file.",
    )
