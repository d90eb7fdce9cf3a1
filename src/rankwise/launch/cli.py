"""``rankwise run`` (and the flags of ``python -m rankwise.launch``): flags -> LaunchOptions.

Flag names are torchrun's, in both spellings (``--nproc-per-node`` and ``--nproc_per_node``),
so a torchrun command line works after replacing ``torchrun`` with ``rankwise run``. A flag
not given is None here: ``settings.resolve`` fills it from ``rankwise.toml`` (or
``pyproject.toml``'s ``[tool.rankwise]``, or ``--config FILE``), else from its default.
No logic here: parse, resolve the settings, build the frozen options, call ``launch``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_args import flag as _flag
from .options import DEFAULT_RDZV_TIMEOUT_S


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The torchrun-style flags shared by ``rankwise run`` and the legacy launcher, the
    settings file, and what to run."""
    add_launch_flags(parser)
    add_config_flag(parser)
    from ..dashboard.cli import add_run_flags

    add_run_flags(parser)  # --dashboard, --dashboard-host, --dashboard-port
    # Not in add_launch_flags: a secret is given here or by the environment, never written
    # into a settings file (rankwise config does not take it; settings.py refuses the key).
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
        "profile-steps",
        type=int,
        default=None,
        metavar="N",
        help="record every rank's step anatomy every N steps, in the job's run directory "
        "(default 10; 1: every step, the dense view; 0: off)",
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


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    _flag(
        parser,
        "config",
        metavar="FILE",
        help="settings file (default: ./rankwise.toml, else ./pyproject.toml's [tool.rankwise]); "
        "flags given on the command line override it",
    )


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The flags a settings file may also give (``rankwise run`` and ``rankwise config``)."""
    _flag(
        parser,
        "nproc-per-node",
        metavar="N|auto",
        help="workers on this node: a number, or 'auto' (one per GPU, else per CPU core)",
    )
    _flag(parser, "nnodes", metavar="N|MIN:MAX", help="number of nodes (default 1)")
    _flag(
        parser,
        "node-rank",
        type=int,
        metavar="N",
        help="index of this node, 0..nnodes-1",
    )
    _flag(
        parser,
        "master-addr",
        metavar="HOST",
        help="address of node 0 (default 127.0.0.1)",
    )
    _flag(
        parser,
        "master-port",
        type=int,
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
        metavar="BACKEND",
        help="'static' (default) or 'c10d' (elastic)",
    )
    _flag(
        parser,
        "rdzv-endpoint",
        metavar="HOST:PORT",
        help="where the nodes meet (c10d)",
    )
    _flag(parser, "rdzv-id", metavar="ID", help="job id shared by all nodes (c10d)")
    _flag(
        parser,
        "rdzv-conf",
        metavar="KEY=VALUE,...",
        help="torch's c10d rendezvous settings, e.g. keep_alive_interval=1,"
        "keep_alive_max_attempt=4 (a lost node is dropped in 4 s, not 15; docs/elastic.md)",
    )
    _flag(
        parser,
        "rdzv-timeout",
        type=int,
        metavar="SECONDS",
        help=f"wait this long for the other nodes / the master (default {DEFAULT_RDZV_TIMEOUT_S})",
    )


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Standalone mode, restarts, output, and what to run."""
    _flag(
        parser,
        "standalone",
        action="store_true",
        default=None,
        help="single node on a free local port (the default for one node without --master-port)",
    )
    _flag(
        parser,
        "max-restarts",
        type=int,
        metavar="N",
        help="restart the worker group this many times after a failure (default 0)",
    )
    _flag(
        parser,
        "log-dir",
        metavar="DIR",
        help="keep each worker's stdout/stderr files here",
    )
    _flag(parser, "no-prefix", action="store_true", default=None, help="do not prefix output lines with [rankN]:")
    _flag(
        parser,
        "debug",
        action="store_true",
        default=None,
        help="check every torch.distributed collective across ranks before it runs "
        "(TORCH_DISTRIBUTED_DEBUG=DETAIL; slower, see docs/diagnose.md)",
    )


def settings_from_args(args: argparse.Namespace):
    """The effective settings: flags given, then the settings file, then the defaults."""
    from .config.settings import resolve

    return resolve(vars(args), Path.cwd(), getattr(args, "config", None))


def options_from_args(
    args: argparse.Namespace, *, pass_local_rank: bool = False, settings=None
):
    """The frozen ``LaunchOptions`` for parsed flags and the settings file (errors name the
    flag and its value)."""
    from .options import LaunchOptions, parse_nnodes, resolve_nproc

    s = (settings or settings_from_args(args)).values
    min_nodes, nnodes = parse_nnodes(str(s["nnodes"]))
    return LaunchOptions(
        script=args.script,
        script_args=tuple(args.script_args),
        module=args.module,
        nproc_per_node=resolve_nproc(str(s["nproc-per-node"])),
        nnodes=nnodes,
        min_nodes=min_nodes,
        node_rank=s["node-rank"],
        master_addr=s["master-addr"],
        master_port=s["master-port"],
        rdzv_backend=s["rdzv-backend"],
        rdzv_endpoint=s["rdzv-endpoint"],
        rdzv_id=s["rdzv-id"],
        rdzv_token=args.rdzv_token,
        rdzv_timeout=s["rdzv-timeout"],
        rdzv_conf=s["rdzv-conf"],
        standalone=s["standalone"],
        max_restarts=s["max-restarts"],
        log_dir=s["log-dir"],
        prefix_output=not s["no-prefix"],
        pass_local_rank=pass_local_rank,
        monitor_interval=args.monitor_interval,
        debug=s["debug"],
        profile_steps=getattr(args, "profile_steps", None),
    )


def run_command(args: argparse.Namespace, *, pass_local_rank: bool = False) -> int:
    """Launch and return the exit code: 0, the failing rank's code, or 128 + signal."""
    from .engine import LaunchInterrupted, launch
    from .failures.report import JobFailed

    settings = settings_from_args(args)
    said = settings.announce()
    if said:
        print(said, file=sys.stderr, flush=True)
    opts = options_from_args(args, pass_local_rank=pass_local_rank, settings=settings)
    try:
        with _dashboard(args):
            launch(opts)
    except (JobFailed, LaunchInterrupted) as exc:
        print(f"rankwise run: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


def _dashboard(args: argparse.Namespace):
    """The web page of the job while it runs (``--dashboard``), else nothing."""
    from ..dashboard.launcher import default_run_dir, serving

    # The directory is named as the job starts (launch): the page asks for it at each visit.
    return serving(bool(getattr(args, "dashboard", False)), default_run_dir,
                   args.dashboard_host, args.dashboard_port)


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
