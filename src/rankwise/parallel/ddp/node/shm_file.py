"""The shared-memory file behind shared-memory buckets: made, agreed on, and never left behind.

Rank 0 creates ``/dev/shm/rankwise-grads-<pid>-<random>`` (reserved with ``posix_fallocate``,
a random token at its start), offers its name as JSON, every rank maps it, and rank 0 unlinks
it in a ``finally`` (and on SIGTERM/SIGHUP while it is named). Only SIGKILL in that window can
leave it: its name carries rank 0's pid, so the next job (or the launcher, when its workers are
gone) sweeps files whose process is dead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from ....comm import wire
from ....diagnose import fingerprints
from ....errors import DistributedError

SHM_DIR = "/dev/shm"
TOKEN = 16  # header bytes: rank 0's random token, proof that a rank mapped the same file

PREFIX = "rankwise-grads-"
"""Shared files are named ``rankwise-grads-<pid of rank 0>-<random>``: a file whose process is
gone is stale (rank 0 was SIGKILLed between creating and unlinking it) and is swept."""


def sweep_stale(shm_dir: str | None = None) -> list[str]:
    """Unlink this user's ``rankwise-grads-<pid>-*`` files whose process no longer exists.

    Called before creating a file (and by the launcher when its workers are gone): a rank
    killed with SIGKILL in the short window between creating and unlinking cannot clean up.
    """
    folder = shm_dir or SHM_DIR
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PREFIX) :].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(folder, name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass  # another sweeper was first, or not ours
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def create(nbytes: int) -> tuple[str, bytes] | None:
    """Rank 0: a /dev/shm file of ``nbytes``, reserved now, with a random token at its start."""
    sweep_stale()
    try:
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_DIR)
    except OSError:
        return None
    token = secrets.token_bytes(TOKEN)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # tmpfs out of room fails here, not with SIGBUS
        os.pwrite(fd, token, 0)
    except (OSError, AttributeError) as exc:  # AttributeError: no posix_fallocate (macOS)
        os.unlink(path)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            _warn_no_room(nbytes)
        return None
    finally:
        os.close(fd)
    return path, token


def _warn_no_room(nbytes: int) -> None:
    """Say once why a job on one machine is slower than it could be (Docker's 64 MiB)."""
    free = shutil.disk_usage(SHM_DIR).free
    warnings.warn(
        f"{SHM_DIR} has {free / 2**20:.0f} MiB free, and averaging gradients through shared "
        f"memory needs {nbytes / 2**20:.0f} MiB: they go through Gloo's all-reduce instead "
        "(slower on one machine). Fix: give the container more shared memory "
        "(docker run --shm-size=1g ...), or pass shared_memory_reduce=False to silence this.",
        RuntimeWarning,
        stacklevel=2,
    )


def agree(
    made: tuple[str, bytes] | None, nbytes: int, ranks: list[int], group: dist.ProcessGroup
) -> torch.Tensor | None:
    """Every rank maps rank 0's file, or none uses it. Rank 0 unlinks it whatever happens.

    The name and token travel as JSON (never pickled); a name outside ``SHM_DIR``'s
    ``rankwise-grads-*`` files is refused, so a peer cannot make this rank map another file.
    """
    try:
        with _unlink_on_signal(made[0] if made else None):
            offer = None if made is None else [made[0], made[1].hex()]
            got = wire.broadcast_json(offer, label="shared-memory buckets", group=group)
            if _IN_WINDOW is not None:
                _IN_WINDOW()
            arena = map_file(*_offered(got, ranks[0]), nbytes) if got is not None else None
            ok = torch.tensor([0 if arena is None else 1], dtype=torch.int32)
            label = "shared-memory buckets"
            with fingerprints.collective("all_reduce", ok, label=label, group=group):
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    finally:
        if made is not None:
            _unlink(made[0])  # every rank has mapped it (or given up): the mapping outlives it
    return arena if ok.item() == 1 else None


_IN_WINDOW: Callable[[], None] | None = None
"""Test hook: called on every rank while rank 0's file exists, before mapping it."""


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _offered(got: object, src: int) -> tuple[str, bytes]:
    """Rank 0's ``[path, token hex]``, checked to name one of our files in ``SHM_DIR``."""
    ok = isinstance(got, list) and len(got) == 2 and all(isinstance(x, str) for x in got)
    path = got[0] if ok else ""
    name = os.path.basename(path)
    if not (ok and os.path.dirname(path) == SHM_DIR and name.startswith(PREFIX)):
        raise DistributedError(
            f"rank {src} offered {str(got)[:120]!r} as the shared-memory bucket file, not a "
            f"{SHM_DIR}/{PREFIX}* file; refusing to map it",
            fix="every rank must run the same rankwise version; a rank that sends anything else "
            "is not part of this job.",
            rank=dist.get_rank(),
        )
    try:
        return path, bytes.fromhex(got[1])
    except ValueError:
        raise DistributedError(
            f"rank {src} sent a malformed shared-memory token {got[1][:40]!r}",
            fix="every rank must run the same rankwise version.",
            rank=dist.get_rank(),
        ) from None


class _unlink_on_signal:
    """While rank 0's file is named, SIGTERM/SIGHUP unlink it before the process ends.

    ``finally`` covers errors and KeyboardInterrupt; a plain SIGTERM (a launcher stopping the
    job) would end the process without it. Signal handlers exist only in the main thread;
    elsewhere, and for SIGKILL, ``sweep_stale`` removes the file at the next start.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self, path: str | None) -> None:
        self.path, self.previous = path, {}

    def _handle(self, signum: int, frame: object) -> None:
        _unlink(self.path)
        self.__exit__()
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, frame)
        else:
            os.kill(os.getpid(), signum)  # the default action, now that the file is gone

    def __enter__(self) -> _unlink_on_signal:
        if self.path is not None and threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def map_file(path: str, token: bytes, nbytes: int) -> torch.Tensor | None:
    """Map ``path`` if it is rank 0's file (same token): a rank elsewhere has no such file.

    A symlink, or a file of another size, is not ours (never map a file a peer points at).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes or os.pread(fd, TOKEN, 0) != token:
            return None
    finally:
        os.close(fd)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)
