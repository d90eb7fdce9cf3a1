"""``rankwise config``: write ``rankwise run``'s settings file, or show the effective settings.

- ``rankwise config`` asks a few questions (a default in brackets: Enter keeps it; the
  defaults are the file's current values) and writes ``./rankwise.toml``;
- ``rankwise config --nproc-per-node 2 --max-restarts 1`` writes those flags without asking
  (into the file's other settings);
- ``rankwise config --show`` (``--json``) prints every setting, its value and where it came
  from: the command line, the file, or the default.

The questions read standard input line by line, so a script (or a test) can feed the answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from ...cli_args import flag as _flag
from ...errors import ConfigError
from ..cli import add_config_flag, add_launch_flags
from . import settings as st

_QUESTIONS: tuple[tuple[str, str, bool], ...] = (
    # setting, question, only asked for several nodes
    ("nproc-per-node", "processes on this machine (a number, or 'auto': one per GPU/core)", False),
    ("nnodes", "machines in the job (a number, or MIN:MAX for an elastic job)", False),
    ("node-rank", "this machine's index, 0 .. machines - 1", True),
    ("master-addr", "address of machine 0, reachable from every machine", True),
    ("master-port", "port on machine 0 (empty: a free one on one machine)", True),
    ("rdzv-timeout", "seconds to wait for the other machines", True),
    ("max-restarts", "restarts of all workers after a failure", False),
    ("log-dir", "folder for each worker's output files (empty: none)", False),
)


def config_command(args: argparse.Namespace) -> int:
    """Write the settings file (asking, or from the flags given), or show the settings."""
    if args.show or args.json:
        return _show(args)
    given = {k: getattr(args, st.dest(k)) for k in st.DEFAULTS}
    given = {k: v for k, v in given.items() if v is not None}
    path = st.target(Path.cwd(), args.config)  # the file that holds the settings already
    current = _current(path)
    values = {**current, **given} if given else ask(current, sys.stdin, sys.stdout)
    st.write(path, values)
    shown = ", ".join(f"{k} = {st.show_value(v)}" for k, v in values.items()) or "no setting"
    table = " [tool.rankwise]" if path.name == st.PYPROJECT else ""
    print(f"rankwise config: wrote {_relative(path)}{table}: {shown}")
    print(f"rankwise run reads it in {path.resolve().parent}; flags on its command line win.")
    hidden = st.shadowed(Path.cwd(), path if path.parent.resolve() == Path.cwd().resolve()
                         else None, args.config)  # fmt: skip
    if hidden:
        print(f"rankwise config: note: {st.Settings({}, {}, shadowed=hidden).shadow_line()}")
    return 0


def _relative(path: Path) -> Path:
    """``path`` as the user would write it: relative to the current folder when inside it."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def _current(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return st.check(st.find(path.parent, str(path))[1], path)  # type: ignore[index]


def ask(current: dict[str, Any], stdin: TextIO, stdout: TextIO) -> dict[str, Any]:
    """The answers to the questions (Enter keeps the value in brackets), over ``current``."""
    print("rankwise config: rankwise run's settings for this folder. Enter keeps the value in "
          "[brackets].", file=stdout)
    values = dict(current)
    for key, question, several_nodes in _QUESTIONS:
        if several_nodes and str(values.get("nnodes", "1")) == "1":
            continue
        default = values.get(key, st.DEFAULTS[key])
        answer = _ask_one(key, question, default, stdin, stdout)
        if answer == st.DEFAULTS[key] and key != "nproc-per-node":
            values.pop(key, None)  # the default needs no line
        else:
            values[key] = answer
    return values


def _ask_one(key: str, question: str, default: Any, stdin: TextIO, stdout: TextIO) -> Any:
    for _ in range(3):
        shown = "" if default is None else st.show_value(default).strip('"')
        print(f"{question} (--{key}) [{shown}]: ", end="", file=stdout, flush=True)
        line = stdin.readline()
        text = line.strip()
        if not stdin.isatty():  # answers from a file or a pipe: show them after the question
            print(text, file=stdout)
        if not line or not text:  # end of input, or Enter
            return default
        try:
            return st.check({key: _typed(key, text)}, Path("your answer"))[key]
        except ConfigError as exc:
            print(f"  {exc}", file=stdout)
    raise ConfigError(f"no valid answer for {key} after 3 tries",
                      fix=f"run rankwise config --{key} VALUE instead.")


def _typed(key: str, text: str) -> Any:
    """An answer as the type the setting takes: counts as numbers, the rest as written."""
    if key in st.COUNTS:
        return int(text) if text.lstrip("-").isdigit() else text
    return text


def _show(args: argparse.Namespace) -> int:
    s = st.resolve(vars(args), Path.cwd(), args.config)
    if args.json:
        rows = {k: {"value": v, "from": s.sources[k]} for k, v in s.values.items()}
        file = None if s.path is None else str(s.path.resolve())
        print(json.dumps({"file": file, "settings": rows, "not_read": s.shadowed}, indent=2))
        return 0
    print(f"settings file: {s.where}" if s.path else
          f"settings file: none ({st.FILE_NAME} or [tool.rankwise] in {st.PYPROJECT} here)")
    if s.shadow_line():
        print(f"note: {s.shadow_line()}")
    print(f"{'setting':<16} {'value':<18} from")
    for key, value in s.values.items():
        shown = "-" if value is None else st.show_value(value)
        print(f"{key:<16} {shown:<18} {s.sources[key]}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rankwise config`` to the ``rankwise`` command."""
    parser = subparsers.add_parser(
        "config",
        help="write rankwise run's settings file (rankwise.toml), or show the settings",
        description="Without flags: ask a few questions and write ./rankwise.toml. With flags "
        "(the same as rankwise run's): write those. With --show: print every setting, its "
        "value and where it comes from (command line, file, default).",
    )
    add_launch_flags(parser)
    add_config_flag(parser)
    _flag(parser, "show", action="store_true",
          help="print the effective settings and where each comes from; write nothing")
    _flag(parser, "json", action="store_true", help="print the settings as JSON (implies --show)")
    parser.set_defaults(func=config_command)
