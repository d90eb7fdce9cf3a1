"""The dashboard's web server: a Flask app over a run directory, served by werkzeug in a thread.

``rankwise run --dashboard`` starts it in the launcher (``serve`` returns a ``Server`` whose
``close()`` stops it); ``rankwise dashboard RUN_DIR`` serves a finished run in the foreground.
Bound to loopback by default. Bound elsewhere, every request must carry the token
(``?token=...``, compared in constant time), or it gets 403: the page shows the job's hang
diagnoses, which name hosts and paths.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .page import TEMPLATE, WAITING
from .records import STEPS_FILE, RunView
from .summary import human_age, straggler_line, summarize

SUMMARY_FILE = "summary.txt"
"""Rank 0's end-of-run table in the run directory (``timing.recorder``)."""
RunDir = str | Path | Callable[[], str | None]
"""A run directory, or a function that names it once it is known."""
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8470
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
"""No script, nothing fetched from anywhere: the page is HTML, CSS and inline SVG."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Pictures:
    """The page's SVGs, redrawn when new records arrived, at most every ``min_redraw_s``
    (drawing takes the launcher's CPU, which the workers share). One lock: matplotlib's text
    layout caches are shared between threads."""

    def __init__(self, run_dir: RunDir, last: int, min_redraw_s: float = 5.0) -> None:
        self.run_dir, self.last, self.min_redraw_s = run_dir, last, min_redraw_s
        self.view: RunView | None = None
        self._lock = threading.Lock()
        self._drawn: tuple[int, float, dict[str, Any]] | None = None

    def poll(self) -> RunView | None:
        """The run's records so far; None while the launcher has not named the directory."""
        folder = self.run_dir() if callable(self.run_dir) else self.run_dir
        if folder and (self.view is None or self.view.run_dir != Path(folder)):
            self.view, self._drawn = RunView(folder), None
        if self.view is not None:
            self.view.poll()
        return self.view

    def numbers(self) -> dict[str, Any] | None:
        """The summary as plain data (``/summary.json``); None before the directory is named."""
        with self._lock:
            view = self.poll()
            return None if view is None else asdict(summarize(view, self.last))

    def current(self) -> dict[str, Any] | None:
        from . import plots

        with self._lock:
            if self.poll() is None:
                return None
            if self._drawn is not None and (
                self._drawn[0] == self.view.version
                or time.monotonic() - self._drawn[1] < self.min_redraw_s
            ):
                return dict(self._drawn[2], s=summarize(self.view, self.last))
            s = summarize(self.view, self.last)
            steps = list(self.view.steps)
            shown = plots.ranks_shown(s)
            values = {
                "bars": plots.anatomy_bars(s.ranks, s.straggler.rank if s.straggler else None),
                "over_time": plots.anatomy_over_time(steps, shown),
                "memory": plots.memory(steps, shown),
                "throughput": plots.throughput(steps),
                "shown": shown,
            }
            self._drawn = (self.view.version, time.monotonic(), values)
            return dict(values, s=s)


def end_of_run(run_dir: str, limit: int = 65536) -> str | None:
    """The table rank 0 leaves at the end of the run (``summary.txt``), when it is there."""
    try:
        with open(Path(run_dir) / SUMMARY_FILE, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def create_app(run_dir: RunDir, *, token: str | None = None, refresh_s: int = 2,
               last: int = 20) -> Any:
    """The Flask app serving ``run_dir``'s page (``/``) and its numbers (``/summary.json``).

    ``run_dir`` may be a function: the launcher names the job's directory when it starts it.
    """
    from flask import Flask, abort, jsonify, render_template_string, request

    app = Flask("rankwise.dashboard")
    pictures = Pictures(run_dir, last)

    @app.before_request
    def _check_token() -> None:
        given = request.args.get("token", "")
        if token is not None and not hmac.compare_digest(given.encode(), token.encode()):
            abort(403, "this dashboard needs its token: open the URL rankwise run printed")

    @app.after_request
    def _headers(response):
        response.headers["Content-Security-Policy"] = CSP
        response.headers["Cache-Control"] = "no-store"
        return response

    @app.get("/")
    def index():
        values = pictures.current()
        if values is None:
            return render_template_string(WAITING, refresh=refresh_s)
        age = values["s"].age_s
        return render_template_string(
            TEMPLATE, refresh=refresh_s, steps_file=f"{values['s'].run_dir}/{STEPS_FILE}",
            end_summary=end_of_run(values["s"].run_dir),
            straggler_line=straggler_line(values["s"].straggler),
            age="" if age is None else human_age(age), **values)

    @app.get("/summary.json")
    def summary_json():
        return jsonify(pictures.numbers())

    return app


@dataclass
class Server:
    """A running dashboard: its URL (with the token, when there is one) and ``close()``."""

    url: str
    _server: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def serve(run_dir: RunDir, host: str = LOOPBACK, port: int = DEFAULT_PORT, *,
          token: str | None = None, refresh_s: int = 2) -> Server:
    """Start serving ``run_dir`` in a daemon thread; ``port=0`` picks a free port.

    Raises ConfigError when bound off loopback without a token, or when the port is taken.
    """
    from werkzeug.serving import make_server

    if token is None and not is_loopback(host):
        raise ConfigError(
            f"dashboard host: got {host!r}, which is not loopback, and no token",
            fix="give the dashboard a token, or bind it to 127.0.0.1 and reach it through an "
            "SSH tunnel",
        )
    app = create_app(run_dir, token=token, refresh_s=refresh_s)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:  # bound here: werkzeug's own bind exits the process when the port is taken
        sock = socket.create_server((host.strip("[]"), port), family=family)
    except OSError as exc:
        raise ConfigError(
            f"dashboard port: got {port} on {host}, which cannot be bound ({exc.strerror})",
            fix="pass another --dashboard-port, or 0 for a free one",
        ) from None
    with sock:  # werkzeug serves a duplicate of this descriptor
        server = make_server(host.strip("[]"), port, app, threaded=True, fd=sock.fileno())
    thread = threading.Thread(target=server.serve_forever, name="rankwise-dashboard", daemon=True)
    thread.start()
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    query = f"/?token={token}" if token else "/"
    return Server(f"http://{shown}:{server.port}{query}", server, thread)
