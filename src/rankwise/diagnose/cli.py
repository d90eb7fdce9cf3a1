"""``rankwise doctor``: flags -> ``doctor.run_checks`` -> text or JSON, and an exit status.

No logic here; the checks live in ``doctor.py``. Flags are torchrun's, in both spellings.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from ..cli_args import Parser, flag, positive_int

DESCRIPTION = (
    "Check this machine and environment before a job starts: torch and its backends, GPUs "
    "against --nproc-per-node, the launcher's environment variables, the network interface "
    "towards the master, whether the master port is free, and CPU threads per rank. Every "
    "problem comes with a fix. Exit status: 1 when an error (with --strict, also a warning) "
    "was found, else 0."
)
EPILOG = """examples:
  rankwise doctor                                   this machine, one process
  rankwise doctor --nproc-per-node 4                four ranks on this machine
  rankwise doctor --nnodes 2 --nproc-per-node 4 --master-addr 10.0.0.1 --master-port 29500
  rankwise doctor --json                            machine-readable findings"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flag(
        parser,
        "nproc-per-node",
        type=positive_int,
        default=1,
        metavar="N",
        help="ranks per node (default 1)",
    )
    flag(parser, "nnodes", type=positive_int, default=1, metavar="N", help="nodes (default 1)")
    flag(
        parser,
        "node-rank",
        type=int,
        default=0,
        metavar="N",
        help="index of this node, 0..nnodes-1 (default 0, the master's node)",
    )
    flag(
        parser,
        "master-addr",
        default=None,
        metavar="HOST",
        help="rank 0's host (default $MASTER_ADDR, else 127.0.0.1)",
    )
    flag(
        parser,
        "master-port",
        type=positive_int,
        default=None,
        metavar="PORT",
        help="rank 0's port (default $MASTER_PORT, else 29500)",
    )
    flag(parser, "json", action="store_true", help="print the findings as JSON")
    flag(parser, "strict", action="store_true", help="exit 1 on warnings too")


def run(args: argparse.Namespace) -> int:
    """Run the checks for parsed ``args``, print them, return the exit status."""
    from .doctor import format_text, run_checks

    findings = run_checks(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    bad = {"error", "warn"} if args.strict else {"error"}
    failed = any(f.status in bad for f in findings)
    if args.json:
        print(json.dumps({"ok": not failed, "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        print(format_text(findings))
    return 1 if failed else 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``doctor`` to the ``rankwise`` command; ``args.func(args)`` returns the exit status."""
    parser = subparsers.add_parser(
        "doctor",
        help="check this machine and environment before a job",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``rankwise doctor ...`` (``python -m rankwise doctor``, ``python -m rankwise.diagnose.cli``)."""
    parser = Parser(
        prog="rankwise doctor",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
