"""The dashboard inside ``rankwise run``: started before the workers, stopped after them.

The server is a thread of the launcher process reading the run directory rank 0 writes: no
code runs in the workers, and the pictures are redrawn at most every few seconds (the launcher
shares the machine's cores with them). Off loopback a token is made for the run and printed in
the URL.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
from collections.abc import Iterator

from ..errors import ConfigError
from ..job import env as envmod
from .web import DEFAULT_PORT, RunDir, Server, is_loopback, serve


def require(module: str, what: str) -> None:
    """ConfigError naming the extra to install when ``module`` is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs the {module!r} package: got none installed",
                          fix="pip install 'rankwise[dashboard]'")


def default_run_dir() -> str | None:
    """``RANKWISE_RUN_DIR``: the run directory of the job this process belongs to, or the one
    this launcher named for its workers (``rankwise run`` sets it as the job starts)."""
    return envmod.snapshot().get("RANKWISE_RUN_DIR") or None


def start(run_dir: RunDir, host: str, port: int | None) -> Server:
    """Serve ``run_dir``; the default port, when taken, gives way to a free one."""
    for module in ("flask", "matplotlib"):
        require(module, "the dashboard")
    # werkzeug logs every request to stderr: the launcher's output is the workers'.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    token = None if is_loopback(host) else secrets.token_urlsafe(18)
    try:
        return serve(run_dir, host, DEFAULT_PORT if port is None else port, token=token)
    except ConfigError:
        if port is not None:
            raise
        return serve(run_dir, host, 0, token=token)


@contextlib.contextmanager
def serving(enabled: bool, run_dir: RunDir, host: str, port: int | None
            ) -> Iterator[Server | None]:
    """``rankwise run --dashboard``: the page served while the body (the job) runs."""
    if not enabled:
        yield None
        return
    server = start(run_dir, host, port)
    print(f"rankwise run: dashboard at {server.url}", file=sys.stderr, flush=True)
    try:
        yield server
    finally:
        server.close()
