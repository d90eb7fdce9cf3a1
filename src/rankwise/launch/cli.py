"""``rankwise run`` (and the flags of ``python -m rankwise.launch``): flags -> LaunchOptions.

Flag names are torchrun's, in both spellings (``--nproc-per-node`` and ``--nproc_per_node``),
so a torchrun command line works after replacing ``torchrun`` with ``rankwise run``.
No logic here: parse, build the frozen options, call ``launch``.
"""

from __future__ import annotations

import argparse
import sys

from ..cli_args import flag as _flag
from .options import DEFAULT_RDZV_TIMEOUT_S


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The torchrun-style flags shared by ``rankwise run`` and the legacy launcher."""
    _flag(
        parser,
        "nproc-per-node",
        default="1",
        metavar="N|auto",
        help="workers on this node: a number, or 'auto' (one per GPU, else per CPU core)",
    )
    _flag(parser, "nnodes", default="1", metavar="N|MIN:MAX", help="number of nodes (default 1)")
    _flag(
        parser,
        "node-rank",
        type=int,
        default=0,
        metavar="N",
        help="index of this node, 0..nnodes-1",
    )
    _flag(
        parser,
        "master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="address of node 0 (default 127.0.0.1)",
    )
    _flag(
        parser,
        "master-port",
        type=int,
        default=None,
        metavar="PORT",
        help="port on node 0; one node without it: a free port is picked",
    )
    _add_rendezvous_arguments(parser)
    _add_worker_arguments(parser)


def _add_rendezvous_arguments(parser: argparse.ArgumentParser) -> None:
    """How the nodes meet: torch's rendezvous (static by default, c10d for elastic jobs)."""
    _flag(
        parser,
        "rdzv-backend",
        default="static",
        metavar="BACKEND",
        help="'static' (default) or 'c10d' (elastic)",
    )
    _flag(
        parser,
        "rdzv-endpoint",
        default="",
        metavar="HOST:PORT",
        help="where the nodes meet (c10d)",
    )
    _flag(parser, "rdzv-id", default="none", metavar="ID", help="job id shared by all nodes (c10d)")
    _flag(
        parser,
        "rdzv-token",
        default=None,
        metavar="SECRET",
        help="secret every node of a c10d job shares, to sign the rendezvous state "
        "(default: $RANKWISE_RDZV_TOKEN; one node: generated)",
    )
    _flag(
        parser,
        "rdzv-timeout",
        type=int,
        default=DEFAULT_RDZV_TIMEOUT_S,
        metavar="SECONDS",
        help=f"wait this long for the other nodes / the master (default {DEFAULT_RDZV_TIMEOUT_S})",
    )


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Standalone mode, restarts, output, and what to run."""
    _flag(
        parser,
        "standalone",
        action="store_true",
        help="single node on a free local port (the default for one node without --master-port)",
    )
    _flag(
        parser,
        "max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart the worker group this many times after a failure (default 0)",
    )
    _flag(
        parser,
        "log-dir",
        default=None,
        metavar="DIR",
        help="keep each worker's stdout/stderr files here",
    )
    _flag(parser, "no-prefix", action="store_true", help="do not prefix output lines with [rankN]:")
    _flag(
        parser,
        "debug",
        action="store_true",
        help="check every torch.distributed collective across ranks before it runs "
        "(TORCH_DISTRIBUTED_DEBUG=DETAIL; slower, see docs/diagnose.md)",
    )
    _flag(
        parser,
        "monitor-interval",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the target as a module, like python -m"
    )
    parser.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script"
    )


def options_from_args(args: argparse.Namespace, *, pass_local_rank: bool = False):
    """The frozen ``LaunchOptions`` for parsed flags (errors name the flag and its value)."""
    from .options import LaunchOptions, parse_nnodes, resolve_nproc

    min_nodes, nnodes = parse_nnodes(args.nnodes)
    return LaunchOptions(
        script=args.script,
        script_args=tuple(args.script_args),
        module=args.module,
        nproc_per_node=resolve_nproc(args.nproc_per_node),
        nnodes=nnodes,
        min_nodes=min_nodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_backend=args.rdzv_backend,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_token=args.rdzv_token,
        rdzv_timeout=args.rdzv_timeout,
        standalone=args.standalone,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        prefix_output=not args.no_prefix,
        pass_local_rank=pass_local_rank,
        monitor_interval=args.monitor_interval,
        debug=args.debug,
    )


def run_command(args: argparse.Namespace, *, pass_local_rank: bool = False) -> int:
    """Launch and return the exit code: 0, the failing rank's code, or 128 + signal."""
    from .engine import LaunchInterrupted, launch
    from .report import JobFailed

    try:
        launch(options_from_args(args, pass_local_rank=pass_local_rank))
    except (JobFailed, LaunchInterrupted) as exc:
        print(f"rankwise run: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rankwise run`` to the ``rankwise`` command."""
    parser = subparsers.add_parser(
        "run",
        help="launch a training script on N processes per node (torchrun-compatible)",
        description="Launch a training script with torch.distributed.elastic: one process per "
        "worker, RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set as torchrun does.",
    )
    add_launch_arguments(parser)
    parser.set_defaults(func=run_command)
