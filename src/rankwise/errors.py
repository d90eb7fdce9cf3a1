"""One exception family. Every message says what was wrong, with the user's values, and the fix.

The shape is ``[rank r] what happened: got X, expected Y. Fix: ...`` so that a message read in a
log of twelve interleaved processes still says which process and what to do about it.
"""

from __future__ import annotations

import os
import sys
import warnings


class RankwiseError(Exception):
    """Base of every error rankwise raises on purpose."""

    def __init__(self, message: str, *, fix: str | None = None, rank: int | None = None) -> None:
        self.message = message
        self.fix = fix
        self.rank = rank
        text = message if rank is None else f"[rank {rank}] {message}"
        if fix:
            text = f"{text}\nFix: {fix}"
        super().__init__(text)


class ConfigError(RankwiseError, ValueError):
    """A value given by the user (argument, flag, environment variable) is invalid."""


class ModelError(ConfigError, RuntimeError):
    """The model cannot be trained as wrapped (no trainable parameter, a parameter without a
    gradient, one whose gradient arrives twice). Also a ``RuntimeError``: what torch's
    DistributedDataParallel raises in the same situations (docs/ddp.md lists the mapping)."""


class HookError(ConfigError, TypeError):
    """A hook given by the user has the wrong type (torch raises ``TypeError`` there)."""


class EnvError(ConfigError):
    """The process environment (launcher, Slurm, MPI variables) is malformed or inconsistent."""


class RuntimeStateError(RankwiseError, RuntimeError):
    """rankwise was used in the wrong order (e.g. before ``rw.init()``, or init twice differently)."""


class DistributedError(RankwiseError, RuntimeError):
    """Something went wrong across processes: a rank failed, a collective timed out or disagreed."""


class NoProcessGroupError(RuntimeStateError, ValueError):
    """A launched process (WORLD_SIZE > 1) has no process group yet. Also a ``ValueError``:
    what torch raises when the default process group is missing."""


_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _internal(filename: str) -> bool:
    """rankwise's own files, torch's (a DataLoader drives our sampler) and frozen modules."""
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(getattr(torch, "__file__", None) or "/nonexistent") + os.sep
    return filename.startswith((_HERE, torch_dir, "<frozen"))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line: the first frame outside rankwise and
    torch (a sampler's warning is raised inside torch's DataLoader, several frames below the
    ``for`` loop that caused it; a fixed ``stacklevel`` points into torch)."""
    frame = sys._getframe(1)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<unknown>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )
