"""The launcher's native stderr, filtered: c10's log lines and C++ stack frames go to a file.

Why: torch's C++ code (c10d's TCPStore and socket code) logs through c10's logger straight to
file descriptor 2, not through Python's ``sys.stderr``, so no logging setting of ours reaches
it. An unreachable ``--master-addr`` made it print ~75 lines per connection attempt (a retry
warning carrying a 40-frame C++ stack) before our own message. ``TORCH_CPP_LOG_LEVEL`` would
drop them; we keep them in a file instead and name the file in our message, because they are
what a torch developer asks for (docs/launcher.md, troubleshooting).

While the launcher's agent runs, fd 2 is a pipe; a thread reads it line by line and writes
c10 lines (``[W1130 16:19:03.70 socket.cpp:764] ...``), ``Exception raised from``, ``frame #N``
lines and the blank line closing a stack to the log file, everything else to the real stderr
unchanged, in order. Python's own writes skip the pipe (``sys.stderr`` points at the real
stderr meanwhile), and workers are started with the real stderr (``workers_unfiltered``), so
only the launcher's native output is filtered.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import select
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

NATIVE_LINE = re.compile(
    rb"^(\[[WEIFD]\d{4} \d\d:\d\d:\d\d\.\d+ |Exception raised from |frame #\d+: "
    rb"|<omitting python frames>)"
)
"""A line written by c10's logger or part of a C++ stack it prints."""

IDLE_FLUSH_S = 0.1
"""A partial line (no newline yet, e.g. a prompt) is passed on after this long without data."""


class LineRouter:
    """Splits a byte stream into lines and hands each to ``native`` or ``other``, in order."""

    def __init__(self, other: Callable[[bytes], None], native: Callable[[bytes], None]) -> None:
        self._other = other
        self._native = native
        self._partial = b""
        self._in_native = False  # the blank line that ends a C++ stack belongs to it
        self.kept = 0
        """How many lines went to ``native``."""

    def feed(self, data: bytes) -> None:
        """Route every complete line of ``data`` (with what came before it); keep the rest."""
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._route(line + b"\n")

    def flush(self) -> None:
        """Route the partial line as it is (the stream went idle or ended)."""
        if self._partial:
            line, self._partial = self._partial, b""
            self._route(line)

    def _route(self, line: bytes) -> None:
        native = bool(NATIVE_LINE.match(line)) or (self._in_native and not line.strip())
        self._in_native = native and bool(line.strip())
        if native:
            self.kept += 1
            self._native(line)
        else:
            self._other(line)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # a closed console must not stop the launcher
        while data:
            data = data[os.write(fd, data) :]


class NativeStderr:
    """Context manager: fd 2 filtered through a ``LineRouter`` (``path`` names the log file,
    created in ``log_dir``, else the temporary folder, when the first native line arrives)."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir
        self.path: str | None = None
        self._file: io.BufferedWriter | None = None
        self._router = LineRouter(self._pass_on, self._keep)
        self._thread: threading.Thread | None = None
        self._saved_stderr: Any = None
        self._no_file = False

    @property
    def kept(self) -> int:
        """How many native lines went to ``path`` (0 when none, or no file could be made)."""
        return self._router.kept if self._file is not None else 0

    def _pass_on(self, line: bytes) -> None:
        _write_all(self._real, line)

    def _keep(self, line: bytes) -> None:
        if self._file is None and not self._no_file:
            try:
                if self.log_dir:
                    os.makedirs(self.log_dir, exist_ok=True)
                fd, self.path = tempfile.mkstemp(
                    prefix="rankwise-launcher-", suffix=".log", dir=self.log_dir or None
                )
                self._file = os.fdopen(fd, "ab")
            except OSError:  # no file: better on the console than lost
                self._no_file = True
        if self._file is None:
            self._pass_on(line)
            return
        self._file.write(line)
        self._file.flush()  # complete even if the launcher is killed

    def __enter__(self) -> NativeStderr:
        try:
            sys.stderr.flush()
            self._real = os.dup(2)
        except (OSError, ValueError):  # no fd 2 to filter
            self._thread = None
            return self
        self._read, self._write = os.pipe()
        os.dup2(self._write, 2)
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            if sys.stderr.fileno() == 2:  # not in a notebook, where sys.stderr is not fd 2
                self._saved_stderr = sys.stderr
                # Line-buffered like Python's own stderr: print()'s text and newline are one
                # write, so a pumped line cannot land between them.
                sys.stderr = io.TextIOWrapper(
                    open(self._real, "wb", closefd=False),
                    encoding=sys.stderr.encoding, errors="backslashreplace", line_buffering=True,
                )  # fmt: skip
        self._thread = threading.Thread(target=self._pump, name="rankwise-native-stderr",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        return self

    def _pump(self) -> None:
        try:
            while True:
                ready, _, _ = select.select([self._read], [], [], IDLE_FLUSH_S)
                if not ready:
                    self._router.flush()
                    continue
                data = os.read(self._read, 65536)
                if not data:
                    break
                self._router.feed(data)
            self._router.flush()
        finally:
            os.close(self._read)

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        if self._saved_stderr is not None:
            sys.stderr, self._saved_stderr = self._saved_stderr, None
        os.dup2(self._real, 2)
        os.close(self._write)  # the reader sees the end of the pipe once no process holds it
        self._thread.join(timeout=2.0)
        os.close(self._real)
        if self._file is not None:
            self._file.close()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """fd 2 is the real stderr while inside (for processes started here to inherit it)."""
        if self._thread is None:
            yield
            return
        os.dup2(self._real, 2)
        try:
            yield
        finally:
            os.dup2(self._write, 2)


@contextlib.contextmanager
def workers_unfiltered(native: NativeStderr) -> Iterator[None]:
    """While inside, ``elastic_launch``'s agent starts workers with the real stderr: their
    output (their own C++ frames included) is theirs, and a terminal stays a terminal."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent

    class _Agent(original):  # type: ignore[misc, valid-type]
        def _start_workers(self, worker_group):
            with native.paused():
                return super()._start_workers(worker_group)

    api.LocalElasticAgent = _Agent
    try:
        yield
    finally:
        api.LocalElasticAgent = original
