"""The files of a checkpoint: atomic writes, leftover temporaries, rotation, the ``latest`` pointer.

Rules that keep a checkpoint from ever being lost (docs/checkpoints.md):

- a write goes to a temporary name in the same folder, is fsynced and renamed over its target;
  every temporary name we create is ``.<target name>.<random>.tmp``, so the next save of the
  same target (or any save into the same folder) can find and remove what a killed save left;
- files get the mode ``torch.save`` would give them (0666 minus the umask), not mkstemp's 0600;
- rotation keeps the most recently *written* checkpoints and never removes the file just
  written or the one ``latest`` names, whatever their step numbers say;
- ``latest`` names a file inside its folder, and loading a folder loads exactly that file.

A sharded checkpoint is a folder (``ckpt-<step>/``, torch DCP's layout) written as a whole into
a temporary folder ``.<target name>.<random>.tmp`` and published by one rename
(``publish_dir``); a folder counts as a checkpoint only once it holds DCP's ``.metadata``.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .. import validate
from ..errors import ConfigError

LATEST = "latest"
MAX_STEP = 2**63 - 1
_NAME = re.compile(r"^ckpt-(\d+)(\.pt)?$")
DCP_METADATA = ".metadata"
"""The file that makes a folder a (complete) DCP checkpoint."""


def is_dir_target(path: Path) -> bool:
    """True for a folder of checkpoints; False for one checkpoint (a file, or a sharded
    checkpoint's own folder, which holds ``.metadata``)."""
    if (path / DCP_METADATA).is_file():
        return False
    return path.is_dir() or str(path).endswith(os.sep) or path.suffix == ""


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def _umask() -> int:
    # os.umask can only be read by setting it; /proc avoids the (thread-unsafe) set-and-restore.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must reach the disk
    finally:
        os.close(dir_fd)


def first_os_error(exc: BaseException) -> OSError | None:
    """The first ``OSError`` in ``exc``'s chain (torch's writer hides ENOSPC/EFBIG under an
    ``[enforce fail at inline_container.cc]`` RuntimeError, with the OSError as its context)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def describe_write_error(exc: BaseException, target: Path) -> str:
    """What went wrong writing ``target``, in the disk's words: errno, path, free space."""
    os_error = first_os_error(exc)
    if os_error is None:
        return f"{type(exc).__name__}: {exc}"
    code = errno.errorcode.get(os_error.errno or 0, "?")
    where = os_error.filename or target
    try:
        free = f"{shutil.disk_usage(target.parent).free / 2**20:.0f} MiB free in {target.parent}"
    except OSError:
        free = f"free space in {target.parent} unknown"
    return (
        f"{type(os_error).__name__} [Errno {os_error.errno} {code}] {os_error.strerror} "
        f"writing {os.fspath(where)!r} ({free})"
    )


def remove_leftovers(target: Path) -> None:
    """Delete temporaries that killed writes of ``target`` left (only rank 0 writes: none is live)."""
    for suffix in ("tmp", "old"):
        for stale in target.parent.glob(f".{glob_escape(target.name)}.*.{suffix}"):
            remove(stale)


def remove(path: Path) -> None:
    """Delete a file or a (sharded checkpoint's) folder; nothing if it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def write_atomic(write: Callable[[IO[bytes]], None], target: Path) -> None:
    """Write ``target`` through ``write(file)`` so that it is either the old or the new file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # the mode torch.save would give: shared folders work
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if target.is_dir() and not target.is_symlink():  # a sharded checkpoint saved over
            publish_dir(Path(tmp), target)
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_dir(tmp: Path, target: Path) -> None:
    """Make the complete folder ``tmp`` the checkpoint ``target`` in one step.

    A new target is one ``rename``. An existing one (the same step saved again, a path saved
    over) is swapped with ``renameat2(RENAME_EXCHANGE)`` where the kernel offers it, so
    ``target`` is the old checkpoint, then the new one, never missing; elsewhere the old one is
    first renamed aside (``.<name>.<random>.old``, removed by the next save). The folders are
    fsynced first and the parent after.
    """
    if tmp.is_dir():
        _fsync_dir(tmp)
    if not (target.exists() or target.is_symlink()):
        os.rename(tmp, target)
    elif _exchange(tmp, target):
        remove(tmp)  # now the old checkpoint
    else:
        aside = target.parent / f".{target.name}.{os.urandom(4).hex()}.old"
        os.rename(target, aside)
        os.rename(tmp, target)
        remove(aside)
    _fsync_dir(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where that is not offered."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, exchange = -100, 2
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange)
    return done == 0


def write_text_atomic(text: str, target: Path) -> None:
    write_atomic(lambda f: f.write(text.encode()), target)


def _written_order(paths: list[Path]) -> list[Path]:
    def key(p: Path) -> tuple[int, int]:
        try:
            return (p.stat().st_mtime_ns, step_of(p))
        except FileNotFoundError:
            return (-1, step_of(p))

    return sorted(paths, key=key)


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in a directory written by ``save_checkpoint`` (``ckpt-<step>.pt`` files and
    complete ``ckpt-<step>/`` sharded folders), least recently written first."""
    validate.path("directory", directory, where="rw.list_checkpoints()")
    d = Path(directory)
    if not d.is_dir():
        return []
    return _written_order([p for p in d.iterdir() if _NAME.match(p.name) and _complete(p)])


def _complete(p: Path) -> bool:
    return p.is_file() if p.suffix == ".pt" else (p / DCP_METADATA).is_file()


def check_arguments(
    path: object, model: object, optimizer: object, *, saving: bool, epoch: object = None,
    keep_last: object = 3,
) -> None:
    """``save_checkpoint``/``load_checkpoint``'s arguments by type (``rankwise.validate``), before
    anything is read, gathered or written."""
    where = "rw.save_checkpoint()" if saving else "rw.load_checkpoint()"
    validate.path("path", path, where=where)
    validate.stateful("model", model, where=where, optional=not saving)
    validate.optimizer("optimizer", optimizer, where=where)
    validate.integer("epoch", epoch, minimum=0, optional=True, where=where)
    validate.integer("keep_last", keep_last, where=where, example=3)


def check_step(step: object) -> None:
    if step is None:
        return
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(
            f"step={step!r} ({type(step).__name__}) must be an int",
            fix="pass the integer training step, e.g. step=int(step).",
        )
    if step < 0:
        raise ConfigError(
            f"step={step} must not be negative",
            fix="pass the training step counted from 0 (a negative step names a file that "
            "rotation and loading would never find).",
        )
    if step > MAX_STEP:
        raise ConfigError(
            f"step={step} is larger than {MAX_STEP} (2**63 - 1), the largest step a tensor, a "
            "sampler position or another tool can hold",
            fix="pass the training step (a count of optimizer steps), not a sample count or a "
            "hash.",
        )


def dir_target(directory: Path, step: int | None, suffix: str = ".pt") -> Path:
    """``ckpt-<step>.pt`` (``suffix=""``: the sharded folder ``ckpt-<step>``) in ``directory``;
    warns when ``step`` is below the folder's highest."""
    existing = [step_of(p) for p in list_checkpoints(directory)]
    highest = max(existing, default=None)
    if step is None:
        step = 0 if highest is None else highest + 1
    elif highest is not None and step < highest:
        warnings.warn(
            f"saving step {step} into {os.fspath(directory)!r}, which already holds step "
            f"{highest}: 'latest' will name step {step}, and rotation keeps the most recently "
            "written checkpoints (the older, higher steps go first). If this is a new run, "
            "give it a new folder.",
            stacklevel=4,
        )
    return directory / f"ckpt-{step:08d}{suffix}"


def prune(directory: Path, keep_last: int, just_written: Path) -> None:
    """Keep the ``keep_last`` most recently written checkpoints, always with ``just_written``."""
    keep = {just_written.name}
    for p in reversed(list_checkpoints(directory)):
        if len(keep) >= keep_last:
            break
        keep.add(p.name)
    for old in list_checkpoints(directory):
        if old.name not in keep:
            remove(old)
    # Leftovers of saves killed mid-write (only rank 0 publishes, and it is here, so none is
    # live); a sharded save's temporary folder, and a folder swapped out by a re-save, too.
    for pattern in (".ckpt-*.tmp", f".{LATEST}.*.tmp", ".ckpt-*.old"):
        for stale in directory.glob(pattern):
            remove(stale)


def read_latest(directory: Path) -> Path:
    """The checkpoint ``latest`` names; an error naming the pointer if it is missing or escapes."""
    pointer = directory / LATEST
    if not pointer.is_file():
        found = list_checkpoints(directory)
        if not found:
            raise ConfigError(
                f"no checkpoint in directory {os.fspath(directory)!r}",
                fix="pass a directory written by rw.save_checkpoint, or a checkpoint file.",
            )
        return found[-1]  # no pointer (a folder copied by hand): the most recently written
    name = pointer.read_text().strip()
    if not name or os.path.isabs(name) or Path(name).name != name:
        raise ConfigError(
            f"{os.fspath(pointer)!r} names {name!r}, which is not a file inside "
            f"{os.fspath(directory)!r}",
            fix="write the bare file name of a checkpoint in that folder into 'latest' "
            "(e.g. ckpt-00000700.pt), or load a checkpoint file directly.",
        )
    candidate = directory / name
    if candidate.is_symlink() and candidate.resolve().parent != directory.resolve():
        raise ConfigError(
            f"{os.fspath(pointer)!r} names {name!r}, a link to {os.fspath(candidate.resolve())!r} "
            f"outside {os.fspath(directory)!r}; a checkpoint folder's 'latest' is loaded only "
            "from inside it",
            fix="load that file by its own path if you trust it, or replace the link with the "
            "checkpoint itself.",
        )
    if not (candidate.is_file() or (candidate / DCP_METADATA).is_file()):
        raise ConfigError(
            f"{os.fspath(pointer)!r} names {name!r}, which does not exist",
            fix=f"load one of the checkpoints that are there by file name "
            f"({[p.name for p in list_checkpoints(directory)][-3:]}), or restore {name!r}.",
        )
    return candidate
