"""``rankwise topology --nnodes 3 --nproc-per-node 4 [--json]``: print the rank table."""

from __future__ import annotations

import argparse
import json


def topology_command(args: argparse.Namespace) -> int:
    """Print the table (or its JSON) for the given job shape."""
    from .topology import Topology

    topo = Topology(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node)
    print(json.dumps(topo.to_dict(), indent=2) if args.json else topo.format())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rankwise topology`` to the ``rankwise`` command."""
    parser = subparsers.add_parser(
        "topology",
        help="print which node, rank and local_rank each process of a job gets",
        description="The rank table of a job: global rank = node * nproc_per_node + local_rank; "
        "node 0 / rank 0 is the master.",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=int, default=1, help="processes per node"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=topology_command)
