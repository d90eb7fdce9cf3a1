"""``rankwise check``: argparse in, a report and an exit status out. No logic lives here."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..cli_args import Parser, flag
from ..errors import ConfigError
from .report import exit_code, to_json, to_text
from .rules import RULES
from .runner import check_paths, select_rules

DESCRIPTION = (
    "Statically check PyTorch training scripts for the classic data-parallel pitfalls "
    "(DDP before .to(device), init twice, sampler+shuffle, module. keys, rank-0 guards, hangs, "
    "--local_rank, torch.load, DP batch size, global rank as device, local-rank saves, AMP "
    "clipping, per-rank resume, unreduced metrics, ZeRO state on rank 0, padded evaluation, "
    "BatchNorm on small batches; --list-rules). Exit status: 0 clean (warnings allowed), "
    "1 errors found (or warnings with --strict), 2 a file could not be read or parsed."
)


def _csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", metavar="PATH", help="scripts or directories to check")
    flag(p, "json", action="store_true", help="print the findings (or --list-rules) as JSON")
    flag(
        p,
        "select",
        type=_csv,
        default=[],
        metavar="RULE,...",
        help="only these rules (ids or slugs, comma-separated)",
    )
    flag(p, "ignore", type=_csv, default=[], metavar="RULE,...", help="skip these rules")
    flag(p, "strict", action="store_true", help="exit 1 on warnings too")
    flag(p, "list-rules", action="store_true", help="list the rules and exit")


def run(args: argparse.Namespace) -> int:
    """Run the check described by parsed arguments; return the exit status."""
    if args.list_rules:
        if args.json:
            rules = [
                {"id": r.id, "severity": r.severity.value, "slug": r.slug, "summary": r.summary}
                for r in RULES
            ]
            print(json.dumps(rules, indent=2))
            return 0
        for r in RULES:
            print(f"{r.id}  {r.severity.value:<7}  {r.slug:<34} {r.summary}")
        return 0
    if not args.paths:
        print("rankwise check: error: give at least one PATH (or --list-rules)", file=sys.stderr)
        return 2
    try:
        rules = select_rules(args.select, args.ignore)
    except ConfigError as e:
        print(f"rankwise check: error: {e}", file=sys.stderr)
        return 2
    results = check_paths(args.paths, rules)
    print(to_json(results) if args.json else to_text(results))
    return exit_code(results, strict=args.strict)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``check`` to the ``rankwise`` command; ``args.func(args)`` returns the exit status."""
    p = subparsers.add_parser(
        "check", help="find data-parallel pitfalls in a training script", description=DESCRIPTION
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rankwise.check PATH ...``."""
    p = Parser(prog="rankwise check", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))
