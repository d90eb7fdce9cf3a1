"""Worker-side wrapper: run the user's script as ``__main__`` and record how it died.

Each worker runs ``python -u bootstrap.py [-m] TARGET ARGS...``. The script runs exactly as
under ``python TARGET ARGS...`` (same ``sys.argv``, ``sys.path[0]`` and ``__main__``), so
unmodified torchrun scripts work. If it raises, the traceback is written to the error file
torch's elastic agent gave this worker (``TORCHELASTIC_ERROR_FILE``, the format of
``torch.distributed.elastic.multiprocessing.errors.record``), which is how the launcher's
failure summary can show the last lines of a failing rank's traceback.

Workers die with their launcher: on Linux each one asks the kernel for SIGKILL when its parent
(the launcher, whose elastic agent started it) dies, so a SIGKILLed ``rankwise run`` leaves no
orphan training unsupervised. SIGKILL, not SIGTERM: a user's SIGTERM handler (a checkpoint on
preemption) would enter collectives with peers that are dying too, and hang with no one left
to stop it.

A run ends with ``finish_cleanly``: everything the script can observe of Python's shutdown
happens (threads joined, ``atexit`` handlers run, open files flushed), then the process leaves
without the interpreter's teardown of native libraries, which under load occasionally ended a
finished run with SIGABRT. A run that raised leaves its exception where Python leaves an
uncaught one (``sys.last_value``), so that rankwise tells the other ranks "rank r raised ..."
instead of "finished normally"; a diagnosis the launcher will quote is printed there, once.

This file is executed by path and imports only the standard library: it must not pay for
importing torch (or rankwise) before the user's script does. For the same reason it reads the
variables it needs from ``os.environ`` itself instead of through ``rankwise.job.env``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import io
import json
import os
import runpy
import signal
import sys
import sysconfig
import threading
import time
import traceback

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID = "RANKWISE_LAUNCHER_PID"


def die_with_parent(expected_parent: int | None) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where that is unavailable.

    ``expected_parent`` closes the race where the parent died before the request was made
    (this process was then already re-parented, and no signal will ever come).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _where(filename: str) -> str:
    return filename if filename.startswith("<") else os.path.abspath(filename)


_CARETS = frozenset("^~ ")
_RANKWISE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _internal_dirs() -> tuple[str, ...]:
    """rankwise's, torch's and the standard library's folders (not installed packages)."""
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(getattr(torch, "__file__", None) or "/nonexistent") + os.sep
    return (_RANKWISE, torch_dir, "<frozen")


def _stdlib(filename: str) -> bool:
    paths = sysconfig.get_paths()
    libs = tuple(os.path.join(paths[k], "") for k in ("stdlib", "platstdlib") if k in paths)
    pkgs = tuple(os.path.join(paths[k], "") for k in ("purelib", "platlib") if k in paths)
    return filename.startswith(libs) and not filename.startswith(pkgs)


def _diagnosed(exc: BaseException) -> bool:
    """rankwise's diagnosis of a failure across ranks: its message is the explanation."""
    return any(c.__name__ == "DistributedError" and c.__module__ == "rankwise.errors"
               for c in type(exc).__mro__)  # fmt: skip


def shown_traceback(exc: BaseException, skip: tuple[str, ...] = ()) -> str:
    """The traceback as a person should read it: from the user's code on (``skip``: files of
    frames to leave out at the start, such as this wrapper's), without Python's caret lines.

    For rankwise's diagnosis of a failure across ranks (a ``DistributedError``), only the
    user's own frames and the message: not the backend error it was made from (the message
    quotes what matters of it) nor the frames inside rankwise, torch and the standard library.
    """
    tb = exc.__traceback__
    while tb is not None and _where(tb.tb_frame.f_code.co_filename) in skip:
        tb = tb.tb_next
    if _diagnosed(exc):
        inside = _internal_dirs()
        frames = [
            (f, line) for f, line in traceback.walk_tb(tb or exc.__traceback__)
            if not f.f_code.co_filename.startswith(inside) and not _stdlib(f.f_code.co_filename)
        ]  # fmt: skip
        stack = traceback.StackSummary.extract(iter(frames))
        lines = ["Traceback (most recent call last):\n", *stack.format()] if frames else []
        lines += traceback.format_exception_only(type(exc), exc)
    else:
        lines = traceback.format_exception(type(exc), exc, tb or exc.__traceback__)
    text = "".join(lines)
    return "".join(
        ln for ln in text.splitlines(True) if not (ln.strip() and set(ln.rstrip("\n")) <= _CARETS)
    )


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this wrapper's and runpy's frames: it starts in the user's code."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    return shown_traceback(exc, tuple(ours))


def _live(exc: BaseException, text: str, recorded: bool) -> str:
    """What this worker prints as it fails. With no restart pending and the output on the
    launcher's console (``RANKWISE_SUMMARY_QUOTES``), the launcher's summary quotes the
    traceback ``recorded`` in the error file, so it is printed once, there: here a pointer
    (nothing on a rank whose error another rank of this node already pointed at). A
    diagnosis the summary will quote (written to ``RANKWISE_DIAG_DIR``) likewise."""
    folder, rank = os.environ.get("RANKWISE_DIAG_DIR"), os.environ.get("RANK", "")
    final = os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0"
    quoted = folder and os.path.exists(os.path.join(folder, f"rank{rank}.txt"))
    if _diagnosed(exc) and quoted and final:
        first = (str(exc).splitlines() or [""])[0]
        head = first.split("): ", 1)[0] + ")" if "): " in first else first[:200]
        return f"{type(exc).__name__}: {head}; the diagnosis is quoted in rankwise run's summary\n"
    if not (recorded and final and folder and os.environ.get("RANKWISE_SUMMARY_QUOTES") == "1"):
        return text
    if not _first_to_say(exc, folder, rank):
        return ""  # the same error, pointed at by another rank of this node
    return f"{type(exc).__name__} raised here; its traceback is in rankwise run's summary\n"


def _first_to_say(exc: BaseException, folder: str, rank: str) -> bool:
    """True on the first rank of this node to fail with this exception (type and message) in
    this attempt: it prints the traceback. An error in the script's arguments (a misspelt
    strategy) is the same on every rank; N copies of one traceback bury it. The launcher's
    summary still names every rank that failed."""
    said = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    digest = hashlib.sha256(said).hexdigest()[:20]
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        fd = os.open(os.path.join(folder, f"said-{attempt}-{digest}"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)  # fmt: skip
    except FileExistsError:
        return False
    except OSError:
        return True  # no folder to agree in: say it
    os.write(fd, rank.encode())
    os.close(fd)
    return True


def _record(exc: BaseException, text: str) -> bool:
    """Write the traceback where the launcher's summary reads it; False when it could not."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        return False  # the traceback still reaches stderr
    return True


class _GroupWatch(threading.Thread):
    """Notices a process group alive at any moment, even one the script destroys at its end."""

    def __init__(self) -> None:
        super().__init__(name="rankwise-group-watch", daemon=True)
        self.seen = False

    def run(self) -> None:
        while not self.seen:
            time.sleep(0.5)
            self.seen = _group_now()


def _group_now() -> bool:
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_initialized():
            return True
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        # Set by init_process_group(init_method=...) and kept after destroy_process_group.
        if getattr(c10d, "_default_pg_init_method", None) is not None:
            return True
        return bool(getattr(sys.modules.get("rankwise.job.process_group"), "joined_a_group", False))
    except Exception:  # a module half-imported by the main thread: look again later
        return False


def _warn_if_alone(watch: _GroupWatch) -> None:
    """N processes ran a torch script and rank 0 never joined a group: N identical copies."""
    world = os.environ.get("WORLD_SIZE", "1")
    if os.environ.get("RANK") != "0" or not world.isdigit() or int(world) < 2:
        return
    if "torch" not in sys.modules or watch.seen or _group_now():
        return
    sys.stderr.write(
        f"rankwise run: warning: {world} processes were started, but rank 0 never joined a "
        "process group (no rw.init() or torch.distributed.init_process_group): the "
        f"{world} processes each trained the same model on all of the data, and each wrote "
        "every file it saved. Fix: call rw.init() and split the data with rw.loader (or "
        "DistributedSampler), or run with --nproc-per-node 1. See docs/launcher.md.\n"
    )
    sys.stderr.flush()


def finish_cleanly(code: object = 0) -> None:
    """Do what Python's own exit does for the script, then leave with ``code`` at once.

    The interpreter's teardown frees torch's and Gloo's native objects after Python's state is
    gone; now and then (more often on a loaded machine) one of their threads then ends the
    process with SIGABRT ("terminate called without an active exception"), and
    a finished run is reported as a failed rank. Everything a script can observe happens
    first, in Python's order: non-daemon threads are joined, ``atexit`` handlers run (our
    ``rw.shutdown``, logging, multiprocessing's children), and open files are flushed (which
    ``runpy`` alone does not guarantee: a file the script left open could lose its buffer).
    """
    if not isinstance(code, int):  # sys.exit("message"): Python prints it and returns 1
        if code is not None:
            sys.stderr.write(f"{code}\n")
        code = 0 if code is None else 1
    joiner = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first
    if joiner is not None:
        joiner()
    atexit._run_exitfuncs()
    # Files the script left open, unreachable ones too (still tracked until collected; a
    # collection could close a text file after its buffer and lose the text).
    # By type, not isinstance(): that reads __class__, and some module proxies warn on any
    # attribute (torch.distributed.reduce_op printed a FutureWarning on every rank).
    files = [obj for obj in gc.get_objects() if issubclass(type(obj), io.IOBase)]
    for f in [*files, sys.stdout, sys.stderr]:
        # A broken pipe or a file closed underneath has nothing left to save.
        with contextlib.suppress(Exception):
            if not f.closed and f.writable():
                f.flush()
    os._exit(code)


def _ending_on(exc: BaseException) -> None:
    """Leave ``exc`` where Python leaves an uncaught exception (``sys.last_value``): at exit,
    rankwise then tells the other ranks "rank r raised ..." instead of "finished normally"."""
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    sys.last_exc = exc  # Python 3.12's name for the same


_FORKING = {"pid": 0}
"""The pid of the process about to fork (``os.register_at_fork``'s ``before`` hook)."""


def children_die_with_their_parent() -> None:
    """Every process this rank forks (DataLoader workers, ``multiprocessing``'s fork start
    method) asks to be SIGKILLed when its parent dies: the request is not inherited across
    ``fork``, and a worker stuck in ``__getitem__`` never looks whether its rank is alive
    (torch's own check runs between samples), so it outlived a rank ended by the launcher, a
    stall report, or a ``kill -9``. Linux sends the signal when the *thread* that forked
    ends: fork workers from a thread that lives as long as they do (the main thread does)."""
    os.register_at_fork(
        before=lambda: _FORKING.__setitem__("pid", os.getpid()),
        after_in_child=lambda: die_with_parent(_FORKING["pid"] or None),
    )


def main(argv: list[str]) -> None:
    launcher = os.environ.get(LAUNCHER_PID, "")
    die_with_parent(int(launcher) if launcher.isdigit() else None)
    children_die_with_their_parent()
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    target, args = argv[0], argv[1:]
    # `python script.py` puts the script's folder first on sys.path; `python -m` the cwd.
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    watch = _GroupWatch()
    watch.start()
    try:
        if as_module:
            sys.argv = [target, *args]  # run_module replaces argv[0] with the module's file
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _ending_on(exc)  # sys.exit(3) is no normal end: the others are told (rw.shutdown)
            finish_cleanly(exc.code)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        _ending_on(exc)
        text = _user_traceback(exc)
        sys.stderr.write(_live(exc, text, _record(exc, text)))
        sys.stderr.flush()
        # 1, what Python returns for an uncaught exception; without the interpreter's teardown
        # (seconds with torch loaded on a busy machine: the other nodes' launchers wait for it)
        finish_cleanly(1)
    _warn_if_alone(watch)
    finish_cleanly()


if __name__ == "__main__":
    main(sys.argv[1:])
