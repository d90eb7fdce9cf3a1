"""``run_distributed(fn, world_size)``: run a function in real processes, as a test would want.

Each rank is a spawned process (the child bootstrap is ``rankwise.launch.spawn``, shared with
``rw.launch``) that joins a gloo (or nccl) group through a store the parent
hosts on a free port (no port clash between concurrent tests), runs ``fn(*args)`` and sends back
its return value or its traceback. The parent fails fast: the first failing rank ends the run,
and a run that passes its timeout is a failure that carries every rank's current stack (taken
with faulthandler), never a stuck test suite.
"""

from __future__ import annotations

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
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return the per-rank results in order.

    ``fn`` must be importable by the children (a module-level function, not a lambda).
    With ``init=True`` each rank calls ``rankwise.init(backend)`` first, so ``fn`` can use
    collectives directly; ``init=False`` leaves that to ``fn`` (to test ``init`` itself).
    ``timeout`` bounds the whole run; it is also the collectives' timeout inside the ranks.
    ``env`` adds environment variables in every rank. Raises ``DistributedError`` naming the
    failed (or hung) ranks with their tracebacks.
    """
    values, failures, timed_out = spawn_ranks(
        fn, world_size, args=args, backend=backend, timeout=timeout, env=env, init=init
    )
    if failures:
        what = "timed out" if timed_out else "failed"
        raise DistributedError(report("run_distributed", what, failures, values, world_size))
    return [values[r] for r in range(world_size)]
