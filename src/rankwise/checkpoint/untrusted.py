"""Reading files nobody vouches for: a checkpoint's, a pretrained model's, a peer's pickle.

- ``regular``/``open_regular``: only a regular file is opened. A FIFO would block the open
  (or, opened, the read) until a writer appears, in native code no signal interrupts; a device
  can be endless. The path is ``stat``-ed first, then opened with ``O_NONBLOCK`` (a FIFO
  swapped in between cannot block the open) and ``fstat``-ed again.
- ``inside``: a file named as part of a folder must be in it once links are followed, or in
  one of the folders the caller allows (Hugging Face's cache links a snapshot's files to its
  ``blobs``).
- ``read_capped``: at most ``cap`` bytes are read, whatever the file claims or grows to.
- ``RestrictedUnpickler``: ``find_class`` by allow-list (the subclass's) and ``BUILD`` only on
  instances of the allowed types, with a plain ``{name: value}`` state: ``BUILD`` on a class
  (or a function) would set attributes on it for the whole process (``pathlib.Path.exists``
  replaced, say), and a slot state ``setattr``s whatever it names (``__class__`` too). It is
  pickle's pure-Python unpickler (the C one offers no hook for ``BUILD``): slower (once, on
  this project's shared 2-core machine: 1.7 s against 0.5 s for a ``.metadata`` of 20,000
  tensors).
"""

from __future__ import annotations

import fcntl
import os
import pickle
import stat
from pathlib import Path
from typing import Any, ClassVar

from ..errors import ConfigError

_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
          stat.S_IFDIR: "a folder"}  # fmt: skip


def kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), f"not a regular file (mode {mode:#o})")


def _not_regular(path: Path, what: str, mode: int) -> ConfigError:
    return ConfigError(
        f"{what} {os.fspath(path)!r} is {kind(mode)}, not a regular file; reading it could "
        "block forever or never end",
        fix="replace it with the file itself (copy the checkpoint or model folder again).",
    )


def regular(path: Path, what: str) -> os.stat_result:
    """``path``'s ``stat`` (links followed); a ``ConfigError`` unless it is a regular file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {os.fspath(path)!r}: {exc.strerror}",
                          fix="copy the whole folder again, or load an earlier "
                          "checkpoint.") from None  # fmt: skip
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, what, st.st_mode)
    return st


def open_regular(path: Path, what: str) -> int:
    """A read-only descriptor of the regular file ``path`` (blocking reads, as usual)."""
    regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot open {what} {os.fspath(path)!r}: {exc.strerror}",
                          fix="copy the whole folder again, or load an earlier "
                          "checkpoint.") from None  # fmt: skip
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped for something else after the stat above
        os.close(fd)
        raise _not_regular(path, what, mode)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_capped(path: Path, cap: int, what: str) -> bytes:
    """The bytes of the regular file ``path``; a ``ConfigError`` past ``cap`` bytes, noticed
    from its size and while reading (a file that grows is not read past ``cap``)."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise _too_big(path, what, size, cap)
        parts, total = [], 0
        while chunk := os.read(fd, min(8 << 20, cap + 1 - total)):
            parts.append(chunk)
            total += len(chunk)
            if total > cap:
                raise _too_big(path, what, total, cap)
        return b"".join(parts)
    finally:
        os.close(fd)


def _too_big(path: Path, what: str, size: int, cap: int) -> ConfigError:
    return ConfigError(
        f"{what} {os.fspath(path)!r} is {size} bytes or more; at most {cap} are read",
        fix=f"this is not a {what}; check the folder (or load an earlier checkpoint).",
    )


def inside(path: Path, folder: Path, what: str, also: tuple[Path, ...] = ()) -> None:
    """A ``ConfigError`` unless ``path``, links followed, is in ``folder`` or in ``also``."""
    real = Path(os.path.realpath(path))
    for root in (folder, *also):
        if real.is_relative_to(os.path.realpath(root)):
            return
    raise ConfigError(
        f"{what} {os.fspath(path)!r} is a link to {os.fspath(real)!r}, outside "
        f"{os.fspath(folder)!r}; only files inside the folder are read",
        fix="replace the link with the file itself (cp -L), or pass the folder the file is in.",
    )


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles what ``find_class`` (the subclass's allow-list) lets through; ``BUILD`` sets
    a plain state on instances of ``BUILD_TYPES`` only (module docstring)."""

    BUILD_TYPES: ClassVar[tuple[type, ...]] = ()
    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent reference")

    def load_build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        if isinstance(target, type) or type(target) not in self.BUILD_TYPES:
            what = (f"{target.__module__}.{target.__qualname__}" if isinstance(target, type)
                    else str(target)[:60])  # fmt: skip
            raise pickle.UnpicklingError(
                f"BUILD on {type(target).__name__} {what!r} (setting attributes on anything "
                "but the allowed instances)"
            )
        own = getattr(type(target), "__setstate__", None) is not None  # its own method reads it
        plain = isinstance(state, dict) and all(type(k) is str for k in state)
        if not (own or plain):  # a (dict, slot state) pair setattr()s its second part: refused
            raise pickle.UnpicklingError(f"BUILD of {type(target).__name__} with a state other "
                                         "than a {name: value} dict")  # fmt: skip
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build
