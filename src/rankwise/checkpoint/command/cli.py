"""``rankwise checkpoint inspect DIR`` and ``rankwise checkpoint consolidate DIR OUT``.

No logic here: flags -> ``inspection.inspect`` / ``consolidate.consolidate`` -> text or JSON.
"""

from __future__ import annotations

import argparse
import json

from ...cli_args import flag

DESCRIPTION = (
    "Look into a sharded checkpoint (torch DCP's folder format, what rt.save writes under "
    "zero1/2/3 and on a tensor or pipeline mesh), or turn it into one file."
)
INSPECT = (
    "Print what a sharded checkpoint holds: every key's full shape, dtype, chunks and size; the "
    "world size, mesh, strategy and step it was saved at; each file's size and checksum. DIR is "
    "a checkpoint's folder or a folder of checkpoints (its 'latest'). Exit status 1 when a file "
    "is damaged or missing."
)
CONSOLIDATE = (
    "Write a sharded checkpoint as one file, streamed: one tensor in memory at a time. The "
    "file loads with rw.load_checkpoint (any strategy, any world size) and with "
    "torch.load(weights_only=True)."
)


def _inspect(args: argparse.Namespace) -> int:
    from .inspection import format_text, inspect

    info = inspect(args.dir, verify=not args.no_verify)
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 1 if info["checksums"] == "damaged" else 0


def _consolidate(args: argparse.Namespace) -> int:
    from .consolidate import consolidate

    out = consolidate(args.dir, args.out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``checkpoint`` (``inspect``, ``consolidate``) to the ``rankwise`` command."""
    parser = subparsers.add_parser(
        "checkpoint", help="inspect or consolidate a sharded checkpoint", description=DESCRIPTION
    )
    commands = parser.add_subparsers(dest="checkpoint_command", metavar="COMMAND", required=True)
    p = commands.add_parser("inspect", help="what a sharded checkpoint holds",
                            description=INSPECT)  # fmt: skip
    p.add_argument("dir", metavar="DIR", help="the checkpoint's folder, or a folder of them")
    flag(p, "json", action="store_true", help="print the report as JSON")
    flag(p, "no-verify", action="store_true",
         help="do not read the files to check their checksums (sizes only)")  # fmt: skip
    p.set_defaults(func=_inspect)
    c = commands.add_parser("consolidate", help="write a sharded checkpoint as one file",
                            description=CONSOLIDATE)  # fmt: skip
    c.add_argument("dir", metavar="DIR", help="the checkpoint's folder, or a folder of them")
    c.add_argument("out", metavar="OUT", help="the file to write (e.g. model.pt)")
    c.set_defaults(func=_consolidate)
    return parser
