"""``rankwise topology --nnodes 3 --nproc-per-node 4 [--json]``: print the rank table.

No logic here: flags -> ``Topology`` -> its table or JSON.
"""

from __future__ import annotations

import argparse
import json

from ..cli_args import flag

DESCRIPTION = (
    "Print the rank table of a job: which node, global rank and local_rank each process gets. "
    "global rank = node * nproc_per_node + local_rank; node 0 / rank 0 is the master. "
    "Flags are torchrun's, in both spellings (--nproc-per-node, --nproc_per_node)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Plain int: Topology itself rejects 0 and negatives with a ConfigError that says the fix.
    flag(parser, "nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1)")
    flag(
        parser,
        "nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="processes per node (default 1)",
    )
    flag(
        parser,
        "mesh",
        default=None,
        metavar="DIM=N,...",
        help="also print the device mesh, e.g. data=2,tensor=2 (dims: pipeline, data, tensor; "
        "their product must be the world size): which rank is which coordinate",
    )
    flag(parser, "json", action="store_true", help="print the table as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the table (or its JSON) for the given job shape; return the exit status."""
    from . import Topology

    topo = Topology(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node)
    mesh = _mesh(args.mesh, topo) if args.mesh else None
    if args.json:
        print(json.dumps(topo.to_dict() | ({"mesh": mesh.to_dict()} if mesh else {}), indent=2))
    else:
        print(topo.format() + (f"\n\n{mesh.format(topo.nproc_per_node)}" if mesh else ""))
    return 0


def _mesh(text: str, topo):
    from ..errors import ConfigError
    from ..job.mesh import DeviceMesh, parse_mesh

    mesh = DeviceMesh(parse_mesh(text))
    if mesh.world_size != topo.world_size:
        raise ConfigError(
            f"--mesh {text} has {mesh.world_size} rank(s) but --nnodes {topo.nnodes} x "
            f"--nproc-per-node {topo.nproc_per_node} is {topo.world_size}",
            fix=f"make the mesh sizes multiply to {topo.world_size}, or pass --nproc-per-node "
            f"{mesh.world_size // topo.nnodes} (with --nnodes {topo.nnodes}).",
        )
    return mesh


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``topology`` to the ``rankwise`` command; ``args.func(args)`` returns the status."""
    parser = subparsers.add_parser(
        "topology",
        help="print which node, rank and local_rank each process of a job gets",
        description=DESCRIPTION,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser
