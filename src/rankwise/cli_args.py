"""What every ``rankwise`` sub-command's parser shares: the parser class and flag helpers.

``Parser`` is argparse with two habits added: an unknown flag is an error of the sub-command
that received it (its own usage, not the top-level one) and names the closest valid flag
(``--nprocs-per-node`` -> ``did you mean --nproc-per-node?``), and a mistyped sub-command or
choice names the closest valid one (``rankwise runn`` -> ``did you mean 'run'?``; Python 3.14's
``suggest_on_error`` does this, ours runs on 3.10+). ``flag`` adds a flag in both torchrun
spellings (``--nproc-per-node`` and ``--nproc_per_node``), and its older names as aliases;
``positive_int`` is the type of every count.

The command-line conventions (tests/unit/test_cli_consistency.py enforces them on every
parser): one name per concept (``--nproc-per-node``, ``--node-rank``, ``--comm-max-bytes``,
``--json``...), every long flag in both spellings, every value's metavar explicit in one
style (``N``, ``HOST:PORT``, ``auto|cpu|cuda``, ``NAME,...``), and ``--json`` wherever a
command prints a table.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

_SUGGESTED = (
    "unrecognized arguments",
    "unknown command",
    "unknown choice",
    "the following arguments are required",
)
"""argparse messages an unknown flag can cause (a mistyped flag's value is then taken for a
sub-command or a positional); those are replaced by the unknown flag and its closest match."""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that names an unknown flag's closest valid spelling."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._seen = list(sys.argv[1:] if args is None else args)
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            # Here rather than in the top-level parser, so the usage printed is this command's.
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def error(self, message: str) -> NoReturn:
        if any(s in message for s in _SUGGESTED):
            unknown = self._unknown_flags()
            if unknown:
                message = f"unrecognized argument {unknown[0]}{self._hint(unknown[0])}"
        super().error(message)

    def _unknown_flags(self) -> list[str]:
        flags = []
        for token in getattr(self, "_seen", []):
            if token == "--":
                break
            name = token.split("=", 1)[0]
            if name.startswith("-") and len(name) > 1 and not self._is_known(name):
                flags.append(name)
        return flags

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check, with the closest valid choice named (a mistyped sub-command).
        if action.choices is None or value in action.choices:
            return
        choices = [str(c) for c in action.choices]
        match = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
        command = isinstance(action, argparse._SubParsersAction)
        hint = f"did you mean {match[0]!r}? " if match else ""
        raise argparse.ArgumentError(
            None if command else action,  # "argument COMMAND:" says nothing a user can use
            f"unknown {'command' if command else 'choice'} {value!r} "
            f"({hint}choose from {', '.join(map(repr, choices))})",
        )

    def _is_known(self, name: str) -> bool:
        if name in self._option_string_actions:
            return True
        if name.lstrip("-").replace(".", "").isdigit():
            return True  # a negative number, i.e. a value
        # argparse accepts unambiguous prefixes (allow_abbrev)
        return any(o.startswith(name) for o in self._option_string_actions if len(name) > 2)

    def _hint(self, name: str) -> str:
        options = [o for o in self._option_string_actions if o.startswith("--")]
        match = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        return f" (did you mean {match[0]}?)" if match else f"; see {self.prog} --help"


def flag(
    parser: argparse.ArgumentParser, name: str, *aliases: str, **kwargs: Any
) -> argparse.Action:
    """Add ``--name`` (and ``aliases``, older names) each in both spellings, ``-`` and ``_``.

    The dest is always ``name``'s, so an alias (``--nproc`` for ``--nproc-per-node``) fills
    the same field.
    """
    spellings: list[str] = []
    for n in (name, *aliases):
        for s in (f"--{n}", "--" + n.replace("-", "_"), "--" + n.replace("_", "-")):
            if s not in spellings:
                spellings.append(s)
    kwargs.setdefault("dest", name.replace("-", "_"))
    return parser.add_argument(*spellings, **kwargs)


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts: 1, 2, ... (the message names the value)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def run_main(main: Callable[[], int]) -> int:
    """Call ``main``; a closed pipe (``rankwise topology --json | head``) ends quietly.

    Python's documented recipe: point stdout at devnull so the interpreter's final flush does
    not raise again, and exit 1 like other tools whose reader went away early.
    """
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
