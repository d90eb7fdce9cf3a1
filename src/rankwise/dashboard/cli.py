"""``rankwise top [RUN_DIR]`` (the terminal view) and ``rankwise dashboard RUN_DIR`` (the web
page of a run, finished or not), and the ``--dashboard`` flags ``rankwise run`` shares."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ..cli_args import flag as _flag
from ..cli_args import positive_int
from ..errors import ConfigError

RECORDS_HELP = "the job's run directory (it holds steps.jsonl and events.jsonl)"


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Where the web page is served: ``rankwise run --dashboard`` and ``rankwise dashboard``."""
    from .web import DEFAULT_PORT, LOOPBACK

    _flag(parser, "dashboard-host", default=LOOPBACK, metavar="HOST",
          help=f"address the dashboard listens on (default {LOOPBACK}; any other address "
          "needs the token printed with the URL)")
    _flag(parser, "dashboard-port", type=int, default=None, metavar="PORT",
          help=f"port of the dashboard (default {DEFAULT_PORT}, another free one when it is "
          "taken; 0: a free port)")


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """``rankwise run --dashboard``: serve the running job's page from the launcher."""
    _flag(parser, "dashboard", action="store_true",
          help="serve a web page of the job while it runs: per-rank step anatomy, memory, "
          "throughput, stragglers, hangs (docs/slow.md)")
    add_server_flags(parser)


def _run_dir(given: str | None) -> Path:
    from .launcher import default_run_dir

    found = given or default_run_dir()
    if found is None:
        raise ConfigError("run directory: none given and none found",
                          fix="pass the directory rankwise run printed for the job")
    path = Path(found)
    if not path.is_dir():
        raise ConfigError(f"run directory: got {str(path)!r}, which is not a directory",
                          fix="pass the directory rankwise run printed for the job")
    return path


def top_command(args: argparse.Namespace) -> int:
    from .records import RunView

    view = RunView(_run_dir(args.run_dir))
    if args.json:
        from .summary import summarize

        view.poll()
        json.dump(asdict(summarize(view, args.last)), sys.stdout, indent=2)
        print()
        return 0
    from .launcher import require

    require("rich", "rankwise top")
    from rich.console import Console

    from . import terminal

    console = Console()
    if args.once:
        terminal.print_once(view, console, args.last)
    else:
        terminal.watch(view, console, args.interval, args.last)
    return 0


def dashboard_command(args: argparse.Namespace) -> int:
    from .launcher import start

    server = start(_run_dir(args.run_dir), args.dashboard_host, args.dashboard_port)
    print(f"rankwise dashboard: serving {server.url} (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rankwise top`` and ``rankwise dashboard`` to the ``rankwise`` command."""
    top = subparsers.add_parser(
        "top", help="watch a running job's ranks in the terminal (step anatomy, stragglers)",
        description="A live view of a job's ranks from its run directory: where each rank's "
        "step goes, throughput, memory, the straggler and a hang. Ctrl-C stops.")
    top.add_argument("run_dir", nargs="?", metavar="DIR", help=RECORDS_HELP)
    _flag(top, "once", action="store_true", help="print one frame and exit")
    _flag(top, "json", action="store_true", help="print the numbers of one frame as JSON, exit")
    _flag(top, "interval", type=float, default=1.0, metavar="SECONDS",
          help="seconds between redraws (default 1)")
    _flag(top, "last", type=positive_int, default=20, metavar="N",
          help="average over the last N records (default 20)")
    top.set_defaults(func=top_command)
    page = subparsers.add_parser(
        "dashboard", help="serve the web page of a job's run directory, finished or running",
        description="Serve the dashboard rankwise run --dashboard serves, for any run "
        "directory. Ctrl-C stops.")
    page.add_argument("run_dir", metavar="DIR", help=RECORDS_HELP)
    add_server_flags(page)
    page.set_defaults(func=dashboard_command)
