"""The ``rankwise`` command: a top-level parser and one sub-command per module.

Every sub-command lives in its own module with a ``register(subparsers)`` function that adds
its parser and sets ``func`` (``func(args) -> int``, the exit code) via ``set_defaults``.
Adding a command is one line in ``SUBCOMMANDS``. Keep those modules' top-level imports light
(import the heavy machinery inside ``func``): every command's module is imported to build
the parser. The command line holds no logic: flags -> frozen dataclass -> function.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: tuple[str, ...] = (
    "rankwise.launch.cli",  # rankwise run
    "rankwise.launch.config.cli",  # rankwise config
    "rankwise.topology.cli",  # rankwise topology
    "rankwise.check.cli",  # rankwise check
    "rankwise.diagnose.cli",  # rankwise doctor
    "rankwise.bench.cli",  # rankwise bench
    "rankwise.checkpoint.command.cli",  # rankwise checkpoint inspect|consolidate
    "rankwise.dashboard.cli",  # rankwise top, rankwise dashboard
)
"""Modules that each provide ``register(subparsers)``, in the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The full ``rankwise`` parser with every registered sub-command."""
    from .cli_args import Parser
    from .version import __version__

    # Sub-command parsers inherit the class, so an unknown flag is reported by the command
    # that got it, with its usage and the closest valid flag.
    parser = Parser(
        prog="rankwise",
        description="Data-parallel and model-parallel training for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"rankwise {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rankwise`` and ``python -m rankwise``; returns the exit code.

    A ``ConfigError`` (bad flag or input) exits with 2 like argparse's usage errors; any other
    ``RankwiseError`` with 1. Both print the message with its fix, without a traceback. A reader
    that closes the pipe early (``rankwise topology --json | head``) ends the command quietly.
    """
    from .cli_args import run_main
    from .errors import ConfigError, RankwiseError

    args = build_parser().parse_args(argv)

    def call() -> int:
        try:
            return int(args.func(args) or 0)
        except RankwiseError as exc:
            print(f"rankwise {args.command}: error: {exc}", file=sys.stderr, flush=True)
            return 2 if isinstance(exc, ConfigError) else 1

    code = run_main(call)
    if argv is None and args.command == "run":  # the process is the launcher: leave now
        from .launch.bootstrap import finish_cleanly

        finish_cleanly(code)  # atexit and flushed files, not the seconds of torch's teardown
    return code


if __name__ == "__main__":
    sys.exit(main())
