"""What every ``rankwise`` sub-command's parser shares: the parser class and flag helpers.

``Parser`` is argparse with one habit added: an unknown flag is an error of the sub-command
that received it (its own usage, not the top-level one) and names the closest valid flag
(``--nprocs-per-node`` -> ``did you mean --nproc-per-node?``). ``flag`` adds a flag in both
torchrun spellings (``--nproc-per-node`` and ``--nproc_per_node``); ``positive_int`` is the
type of every count.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

_SUGGESTED = ("unrecognized arguments", "invalid choice", "the following arguments are required")
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


def flag(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> argparse.Action:
    """Add ``--name`` and, when it has a dash, its torchrun underscore spelling as well."""
    spellings = [f"--{name}"]
    if "-" in name:
        spellings.append("--" + name.replace("-", "_"))
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
