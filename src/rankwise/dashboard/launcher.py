"""The dashboard inside ``rankwise run``: started before the workers, stopped after them.

The server is a thread of the launcher process reading the run directory the workers write;
it costs the workers nothing. Off loopback a token is made for the run and printed in the URL.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigError
from ..job import env as envmod
from .web import DEFAULT_PORT, Server, is_loopback, serve


def require(module: str, what: str) -> None:
    """ConfigError naming the extra to install when ``module`` is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what} needs the {module!r} package: got none installed",
                          fix="pip install 'rankwise[dashboard]'")


def default_run_dir() -> Path | None:
    """The run directory of the job this process belongs to, when the environment says."""
    found = envmod.run_dir()
    return Path(found) if found else None


def run_dir_for_launch() -> Path:
    """The run directory the workers write to: the environment's, else a new one, told to
    the workers through the environment."""
    found = default_run_dir()
    if found is None:
        found = Path(tempfile.mkdtemp(prefix="rankwise-run-"))
        envmod.set_run_dir_for_workers(str(found))
    return found


def start(run_dir: str | Path, host: str, port: int | None) -> Server:
    """Serve ``run_dir``; the default port, when taken, gives way to a free one."""
    for module in ("flask", "matplotlib"):
        require(module, "the dashboard")
    # werkzeug logs every request to stderr: the launcher's output is the workers'.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    token = None if is_loopback(host) else secrets.token_urlsafe(18)
    try:
        return serve(str(run_dir), host, DEFAULT_PORT if port is None else port, token=token)
    except ConfigError:
        if port is not None:
            raise
        return serve(str(run_dir), host, 0, token=token)


@contextlib.contextmanager
def serving(enabled: bool, run_dir: str | Path, host: str, port: int | None
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
