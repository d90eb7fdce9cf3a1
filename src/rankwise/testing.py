"""``run_distributed(fn, world_size)``: run a function in real processes, as a test would want.

Each rank is a spawned process (the child bootstrap is ``rankwise.launch.spawn``, shared with
``rw.launch``); with ``RANKWISE_START_METHOD=forkserver`` (this project's own tests) it is
forked from a server that imported torch once: a rank starts without importing torch again.
It joins a gloo (or nccl) group through a store the parent
hosts on a free port (no port clash between concurrent tests), runs ``fn(*args)`` and sends back
its return value or its traceback. The parent fails fast: the first failing rank ends the run,
and a run that passes its timeout is a failure that carries every rank's current stack (taken
with faulthandler), never a stuck test suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

from .errors import DistributedError
from .launch.spawn import report, spawn_ranks


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    backend: str | None = "gloo",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    init: bool = True,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return the per-rank results in order.

    ``fn`` must be importable by the children (a module-level function, not a lambda).
    With ``init=True`` each rank calls ``rankwise.init(backend)`` first, so ``fn`` can use
    collectives directly; ``init=False`` leaves that to ``fn`` (to test ``init`` itself).
    ``timeout`` bounds the whole run; it is also the collectives' timeout inside the ranks.
    ``env`` adds environment variables in every rank. Raises ``DistributedError`` naming the
    failed (or hung) ranks with their tracebacks. ``start_method``: ``"spawn"`` (fresh
    interpreters: what a benchmark of memory wants), or ``"forkserver"`` (each rank still gets
    this process's environment and its stdout/stderr as they are at the call); by default
    ``RANKWISE_START_METHOD``, else ``"spawn"``.
    """
    if start_method is None:
        start_method = os.environ.get("RANKWISE_START_METHOD") or "spawn"
    if (
        start_method not in ("spawn", "forkserver")
        or start_method not in mp.get_all_start_methods()
    ):
        raise ValueError(
            f"start_method={start_method!r} (or RANKWISE_START_METHOD) is not one this machine "
            f"has for run_distributed: use 'spawn', or 'forkserver' where available"
        )
    values, failures, timed_out = spawn_ranks(
        fn, world_size, args=args, backend=backend, timeout=timeout, env=env, init=init,
        start_method=start_method,
    )  # fmt: skip
    if failures:
        what = "timed out" if timed_out else "failed"
        raise DistributedError(report("run_distributed", what, failures, values, world_size))
    return [values[r] for r in range(world_size)]
