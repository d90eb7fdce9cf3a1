"""``rankwise run``'s settings from a file: ``rankwise.toml``, or ``[tool.rankwise]`` in
``pyproject.toml``, in the current folder (or ``--config FILE``).

Each key is a ``rankwise run`` flag without its dashes (``nproc-per-node = 2``; the
``nproc_per_node`` spelling is accepted too). What the command line gives wins over the file,
the file over the defaults; ``rankwise config --show`` prints the result and where each value
came from. An unknown key or a value of the wrong type is a ``ConfigError`` naming the file,
the key and the closest valid key. Pure functions on dicts and paths: the command lines
(``launch/cli.py``, ``launch/config/cli.py``) only call them.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ..options import DEFAULT_RDZV_TIMEOUT_S
from . import pyproject

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

FILE_NAME = "rankwise.toml"
PYPROJECT = "pyproject.toml"

DEFAULTS: dict[str, Any] = {
    "nproc-per-node": 1,
    "nnodes": 1,
    "node-rank": 0,
    "master-addr": "127.0.0.1",
    "master-port": None,
    "rdzv-backend": "static",
    "rdzv-endpoint": "",
    "rdzv-id": "none",
    "rdzv-timeout": DEFAULT_RDZV_TIMEOUT_S,
    "rdzv-conf": "",
    "standalone": False,
    "max-restarts": 0,
    "log-dir": None,
    "no-prefix": False,
    "debug": False,
}
"""Every setting a file may hold (``rankwise run``'s flags), with the value used when neither
the command line nor the file gives one."""

COUNTS = ("node-rank", "master-port", "rdzv-timeout", "max-restarts")
_SWITCHES = ("standalone", "no-prefix", "debug")
_WORDS_OR_COUNTS = ("nproc-per-node", "nnodes")  # 2, "auto"; 2, "1:4"
_WORDS = {"nproc-per-node": r"auto|gpu|cpu", "nnodes": r"\d+:\d+"}


def dest(key: str) -> str:
    """The argparse field of a setting: ``nproc-per-node`` -> ``nproc_per_node``."""
    return key.replace("-", "_")


@dataclass(frozen=True)
class Settings:
    """The effective settings of one command: values (by setting name) and where each came from."""

    values: dict[str, Any]
    sources: dict[str, str]
    """'command line', 'default', or the file's name (with ``[tool.rankwise]`` for pyproject)."""
    path: Path | None = None
    """The file read, if any."""
    from_file: dict[str, Any] = field(default_factory=dict)
    shadowed: dict[str, Any] = field(default_factory=dict)
    """``[tool.rankwise]`` of ``pyproject.toml`` when ``rankwise.toml`` wins over it (not read)."""

    def shadow_line(self) -> str | None:
        """What the file read hides, said (None when it hides nothing)."""
        if not self.shadowed:
            return None
        hidden = ", ".join(f"{k} = {show_value(v)}" for k, v in self.shadowed.items())
        return (f"{PYPROJECT} [tool.rankwise] is not read: {FILE_NAME} wins over it "
                f"(it sets {hidden}; move those into {FILE_NAME} or delete one of the two)")

    @property
    def where(self) -> str:
        """The file, relative to the current folder when it is in it (``rankwise.toml``)."""
        if self.path is None:
            return "no file"
        try:
            shown = str(self.path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            shown = str(self.path)
        return shown + (" [tool.rankwise]" if self.path.name == PYPROJECT else "")

    def announce(self, command: str = "rankwise run") -> str | None:
        """One line saying which file was read and what it set (None when no file was)."""
        if self.path is None:
            return None
        where = self.where
        used = [f"{k} = {show_value(v)}" for k, v in self.from_file.items()
                if self.sources[k] != "command line"]
        over = [f"--{k} {show_value(self.values[k])} (the file's {show_value(v)})"
                for k, v in self.from_file.items() if self.sources[k] == "command line"]
        line = f"{command}: settings from {where}: {', '.join(used) or 'none used'}"
        line += f"; the command line overrides {', '.join(over)}" if over else ""
        hidden = self.shadow_line()
        return line + (f"; {hidden}" if hidden else "")


def show_value(value: Any) -> str:
    """A value as TOML writes it: strings quoted, ``true``/``false``, numbers as they are."""
    if isinstance(value, str):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def find(cwd: Path, explicit: str | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The settings file and its table: ``explicit`` (``--config``), else ``rankwise.toml``,
    else ``pyproject.toml`` with a ``[tool.rankwise]`` table, in ``cwd``; None when none."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(f"--config {explicit}: no such file",
                              fix=f"write one with rankwise config --config {explicit}, or drop "
                              "--config to read ./rankwise.toml.")
        return path, _table(path)
    for name in (FILE_NAME, PYPROJECT):
        path = cwd / name
        if path.is_file():
            table = _table(path)
            if name == FILE_NAME or table:
                return path, table
    return None


def _table(path: Path) -> dict[str, Any]:
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}",
                          fix="fix the line named, or rewrite it with rankwise config.") from None
    if path.name != PYPROJECT:
        return doc
    table = doc.get("tool", {}).get("rankwise", {})
    return table if isinstance(table, dict) else {}


def check(table: dict[str, Any], path: Path) -> dict[str, Any]:
    """The table's settings by their dash names, each checked: the key exists (else the closest
    one is named), the value has the type its flag takes."""
    out: dict[str, Any] = {}
    for raw, value in table.items():
        key = raw.replace("_", "-")
        if key == "rdzv-token":
            raise ConfigError(
                f"{path}: rdzv-token is a secret, and a settings file is not the place for it "
                "(it is copied, committed, shared)",
                fix="remove it from the file; pass --rdzv-token on each node or set "
                "RANKWISE_RDZV_TOKEN in the environment.",
            )
        if key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{path}: unknown setting {raw!r}",
                fix=f"{hint}the settings are rankwise run's flags: {', '.join(DEFAULTS)}.",
            )
        out[key] = _checked(key, value, path)
    return out


def _checked(key: str, value: Any, path: Path) -> Any:
    if key in _SWITCHES:
        ok, want = isinstance(value, bool), "true or false"
    elif key in COUNTS:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif key in _WORDS_OR_COUNTS:
        value = normal(key, value)
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, str) and re.fullmatch(_WORDS[key], value) is not None
        )
        want = "a whole number or " + ('"auto"' if key == "nproc-per-node" else '"MIN:MAX"')
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        raise ConfigError(f"{path}: {key} = {value!r} ({type(value).__name__}) is not {want}",
                          fix=f"write e.g. {key} = {show_value(_example(key))}.")
    _check_range(key, value, path)
    return value


_LEAST = {"nproc-per-node": 1, "nnodes": 1, "node-rank": 0, "master-port": 1,
          "rdzv-timeout": 1, "max-restarts": 0}  # fmt: skip
"""The smallest value each count takes (a job of 0 processes starts nothing)."""


def _check_range(key: str, value: Any, path: Path | str) -> None:
    """A count inside its range; ``MIN:MAX`` nodes with 1 <= MIN <= MAX."""
    if key == "nnodes" and isinstance(value, str) and ":" in value:
        low, high = (int(v) for v in value.split(":"))
        if not 1 <= low <= high:
            raise ConfigError(f"{path}: nnodes = {value!r} is not MIN:MAX with 1 <= MIN <= MAX",
                              fix='write e.g. nnodes = "1:4".')
        return
    if not isinstance(value, int) or isinstance(value, bool) or key not in _LEAST:
        return
    high = 65535 if key == "master-port" else None
    if value < _LEAST[key] or (high is not None and value > high):
        bound = f"between {_LEAST[key]} and {high}" if high else f"at least {_LEAST[key]}"
        raise ConfigError(f"{path}: {key} = {value} is not {bound}",
                          fix=f"write e.g. {key} = {show_value(_example(key))}.")


def normal(key: str, value: Any) -> Any:
    """``nproc-per-node``/``nnodes`` as a number when they are one ("2" -> 2), else the word."""
    if key in _WORDS_OR_COUNTS and isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def _example(key: str) -> Any:
    examples = {"nproc-per-node": 2, "nnodes": 2, "master-port": 29500, "log-dir": "logs"}
    return examples.get(key, DEFAULTS[key])


def resolve(given: dict[str, Any], cwd: Path, explicit: str | None = None) -> Settings:
    """The effective settings: ``given`` (command-line values, None where a flag was not given)
    over the file's over ``DEFAULTS``."""
    found = find(cwd, explicit)
    path, from_file = (None, {}) if found is None else (found[0], check(found[1], found[0]))
    values, sources = {}, {}
    for key, default in DEFAULTS.items():
        if given.get(dest(key)) is not None:
            values[key], sources[key] = normal(key, given[dest(key)]), "command line"
            _check_range(key, values[key], f"--{key}")
        elif key in from_file:
            values[key], sources[key] = from_file[key], path.name  # type: ignore[union-attr]
        else:
            values[key], sources[key] = default, "default"
    return Settings(values, sources, path, from_file, shadowed(cwd, path, explicit))


def shadowed(cwd: Path, path: Path | None, explicit: str | None) -> dict[str, Any]:
    """The ``[tool.rankwise]`` settings that ``./rankwise.toml`` hides (empty when none)."""
    other = cwd / PYPROJECT
    if explicit is not None or path is None or path.name != FILE_NAME or not other.is_file():
        return {}
    try:
        return check(_table(other), other)
    except ConfigError:
        return {"(unreadable)": str(other)}


def target(cwd: Path, explicit: str | None = None) -> Path:
    """The file ``rankwise config`` writes: ``--config``'s, else the file ``rankwise run``
    reads here (so a setting is merged where the others are, never shadowed by a new file),
    else a new ``./rankwise.toml``."""
    if explicit is not None:
        return Path(explicit)
    found = find(cwd)
    return cwd / FILE_NAME if found is None else found[0]


def to_toml(values: dict[str, Any]) -> str:
    """Flat ``key = value`` lines (strings as TOML basic strings: JSON's escapes are TOML's)."""
    lines = []
    for key, value in values.items():
        text = show_value(value) if not isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def write(path: Path, values: dict[str, Any]) -> Path:
    """Write ``values`` to ``path``: a ``rankwise.toml`` (any name but ``pyproject.toml``) is
    replaced whole, atomically; in a ``pyproject.toml`` the ``[tool.rankwise]`` table is
    merged line by line (``pyproject.merge``: the rest of the file kept as it is), or
    appended when it has none."""
    checked = check(values, path)
    if path.name == PYPROJECT:
        text = path.read_text() if path.exists() else ""
        if path.exists() and "rankwise" in tomllib.loads(text).get("tool", {}):
            body = pyproject.merge(text, checked, lambda k, v: to_toml({k: v}).rstrip("\n"))
        else:
            body = text + ("\n" if text and not text.endswith("\n") else "")
            body += f"{chr(10) if text else ''}[tool.rankwise]\n{to_toml(checked)}"
    else:
        body = (
            "# rankwise run's settings (written by rankwise config): each key is a flag of\n"
            "# rankwise run; flags given on the command line override them.\n" + to_toml(checked)
        )
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(body)
    tmp.replace(path)
    return path
