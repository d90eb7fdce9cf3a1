"""``rw.launch(fn, nprocs=2)``: run a function as a job of N processes, from a notebook or code.

Each process gets the environment ``rankwise run`` gives its workers, so ``fn`` calls
``rt = rw.init(...)`` as a launched script would. Their output is printed here, each line
prefixed with ``[rank r]``. When a rank fails, its exception is re-raised here: the same type
and message, with notes naming the rank and carrying its traceback (an exception that cannot
be pickled becomes a ``DistributedError`` with the same text). The return value is the list
of ``fn``'s results in rank order.

How ``fn`` reaches the processes:
- ``fn`` from an importable module, or from a script's ``__main__`` guarded by
  ``if __name__ == "__main__":``: fresh interpreters (``spawn``) import it by name.
- ``fn`` defined in a notebook (or ``python -c``), whose ``__main__`` has no file to import:
  the processes are forked from this one, so they see what the notebook defined. Forking is
  refused once CUDA is initialised here (a forked child cannot use it): launch first, or move
  ``fn`` into a ``.py`` file and import it.
"""

from __future__ import annotations

import functools
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .. import validate
from ..errors import ConfigError, DistributedError
from ..job import env as envmod
from .options import require_function
from .spawn import causes_first, report, spawn_ranks


def _interactive(fn: Callable[..., Any]) -> bool:
    """True for a function of a ``__main__`` that has no file (a notebook, ``python -c``)."""
    while isinstance(fn, functools.partial):  # partial(train, lr=0.1): where train lives
        fn = fn.func
    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None)


def _start_method(fn: Callable[..., Any]) -> str:
    if not _interactive(fn):
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise ConfigError(
                f"rw.launch cannot send fn={fn!r} to new processes ({type(exc).__name__}: {exc})",
                fix="pass a function defined at module level (not a lambda or a nested "
                "function), e.g. `def train(): ...` in your notebook or in a .py file.",
            ) from None
        return "spawn"
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ConfigError(
            f"rw.launch would fork this notebook to run {fn.__name__}() (it is defined in "
            "__main__, which new interpreters cannot import), but CUDA is already initialised "
            "here and a forked process cannot use it",
            fix="call rw.launch before anything touches CUDA in the notebook (restart the "
            "kernel), or move the function into a .py file and import it.",
        )
    return "fork"


def _check_arguments(args: Any, kwargs: Any, timeout: Any, env: Any) -> None:
    """``rw.launch``'s other arguments by type (``rankwise.validate``), before any process
    starts."""
    where = "rw.launch()"
    validate.sequence("args", args, "a tuple of positional arguments", where=where,
                      example="(lr,) (a one-element tuple needs its comma)")  # fmt: skip
    if kwargs is not None:
        validate.mapping("kwargs", kwargs, "a dict of keyword arguments", where=where,
                         example="{'lr': 0.1}")  # fmt: skip
    validate.timeout("timeout", timeout, where=where)
    if env is not None:
        validate.mapping("env", env, "a dict of environment variables", where=where,
                         example="{'OMP_NUM_THREADS': '1'}")  # fmt: skip
        for key, value in env.items():
            if not (isinstance(key, str) and isinstance(value, str)):
                validate.fail(f"env[{key!r}]", value, "a str (environment values are text)",
                              where=where, fix=f"pass env={{{key!r}: {str(value)!r}}}.")  # fmt: skip


def launch_function(
    fn: Callable[..., Any],
    nprocs: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` new processes forming one job; return their
    results.

    ``timeout`` (seconds, None: none) bounds the whole run; a run past it fails with every
    rank's stack. Raises the first failing rank's exception (notes: rank, traceback).
    """
    require_function(fn)  # a script or LaunchOptions belongs to rankwise.launch.launch
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(
            f"rw.launch(nprocs={nprocs!r}): nprocs must be a positive integer",
            fix="pass the number of processes to start, e.g. nprocs=2.",
        )
    _check_arguments(args, kwargs, timeout, env)
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    # Each line is printed here with "[rank r] ": the rank-aware logger leaves out its own.
    env = {**envmod.rank_prefix_env(True), **(env or {})}
    values, failures, timed_out = spawn_ranks(
        fn,
        nprocs,
        args=tuple(args),
        backend=None,
        timeout=timeout,
        env=env,
        init=False,  # fn calls rw.init(...) with its own strategy and precision
        stream=True,
        start_method=_start_method(fn),
    )
    if not failures:
        return [values[r] for r in range(nprocs)]
    text = report("rw.launch", "timed out" if timed_out else "failed", failures, values, nprocs)
    rank, first = next(iter(causes_first(failures).items()))  # the rank that raised, if one did
    if first.exception is None:
        raise DistributedError(text, rank=rank)
    exc = first.exception
    exc.add_note(f"[rank {rank} of {nprocs}] raised this in rw.launch; its traceback:")
    exc.add_note(first.text.rstrip())
    exc.rank = rank  # type: ignore[attr-defined]
    raise exc
