"""The process group's life: created through torch's rendezvous, destroyed once, also at exit.

Part of the ground floor with ``runtime`` (which decides *what* to create): this module imports
only ``env``, ``netif`` and ``errors``.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..errors import DistributedError
from . import env as envmod
from . import netif
from .env import DistEnv

joined_a_group = False
"""True once this process joined a group through ``rw.init`` (the launcher's bootstrap reads it
to tell a lone copy of a script from a rank, docs/launcher.md)."""

_destroyed = {"groups": 0}
"""Process groups this process created and destroyed (each rank counts the same)."""
_timeout: dict[str, timedelta | None] = {"job": None}
_kept: dict[str, dist.Store | None] = {"store": None}
"""The store of this process's first group made through torch's ``env://`` (``create``)."""
"""The timeout the default group was made with (``create``), or adopted with (``rw.init``)."""


def create(
    env: DistEnv, backend: str, timeout: timedelta, *, exported: bool, debug: bool = False
) -> None:
    """Create the default process group with ``backend``. Sync point: all ranks."""
    global joined_a_group
    _timeout["job"] = timeout
    if "gloo" in backend:
        netif.point_gloo_at(env.master_addr)
    if debug:  # read when the group is created; the env var reaches the ranks' own children
        envmod.set_collective_debug()
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    # torch's env:// reads RANK/MASTER_* itself: give it the values we were given or detected.
    if exported or env.source in ("slurm", "mpi"):
        envmod.export_for_torch(env)
    try:
        dist.init_process_group(
            backend=backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            **_rendezvous(env, timeout),
        )
    except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
        raise DistributedError(
            f"could not join the job at MASTER_ADDR={env.master_addr} "
            f"MASTER_PORT={env.master_port} as rank {env.rank} of {env.world_size} "
            f"within {timeout.total_seconds():.0f}s ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
            fix="check that rank 0 is running and that MASTER_ADDR/MASTER_PORT reach it "
            "from this machine (`rankwise doctor`), or raise the timeout.",
            rank=env.rank,
        ) from exc
    joined_a_group = True
    if _kept["store"] is None and not env.agent_store:
        # torch's env:// store: rank 0 hosts it. Kept for the process's life, so that rank 0's
        # server outlives this group and a later rw.init meets there again, under a new prefix.
        _kept["store"] = dist.distributed_c10d._get_default_store()


def adopt_timeout(timeout: timedelta | None) -> None:
    """The job's timeout for a default group made outside ``create`` (``rw.init`` adopting
    the user's): the groups rankwise makes later get it (None: the user's group's own)."""
    _timeout["job"] = timeout


def job_timeout() -> timedelta:
    """The job's timeout: ``rw.init``'s, else the default group's own, else the default."""
    if _timeout["job"] is not None:
        return _timeout["job"]
    try:  # a group made with torch alone: its backend's options hold its timeout
        import torch

        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # no group, or a backend without options: rankwise's default
        return timedelta(seconds=envmod.DEFAULT_TIMEOUT_S)


def new_group(ranks: list[int] | None = None, **kwargs) -> dist.ProcessGroup:
    """``dist.new_group`` with the job's timeout unless ``timeout`` is given: torch's own
    default is 30 minutes whatever the job asked for, so a group made without one would
    outwait the stall report and the job's timeout alike (every group rankwise makes is made
    here). Sync point: as ``dist.new_group`` (the members, or every rank)."""
    if kwargs.get("timeout") is None:
        kwargs["timeout"] = job_timeout()
    return dist.new_group(ranks, **kwargs)


def destroy() -> None:
    """Destroy the default group (local, no sync point); a later ``create`` uses fresh keys."""
    if dist.is_initialized():
        dist.destroy_process_group()
        _destroyed["groups"] += 1
    _timeout["job"] = None


def _rendezvous(env: DistEnv, timeout: timedelta) -> dict:
    """How ``init_process_group`` finds its peers: torch's ``env://``, with one exception.

    Under the launcher's agent the store outlives a restart of the worker group. The keys the
    previous attempt's ranks left in it (their Gloo addresses among them) would be read as
    the new ranks' and the connection refused; a prefix per attempt keeps attempts apart.
    """
    if not env.agent_store:
        if _destroyed["groups"] == 0 or _kept["store"] is None:
            return {"init_method": "env://"}
        # A group made again (rw.shutdown(), rw.init()) where rank 0 hosts the store (a c10d job
        # across hosts, torchrun's env://): the first group's keys (its Gloo addresses, the
        # ranks that "finished") are still there and would be read as this group's: the job
        # hung in the second rw.init, then blamed the user's code. The same store, a new prefix.
        return {"store": dist.PrefixStore(f"/rankwise/init_{_destroyed['groups']}", _kept["store"])}
    store = dist.TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout
    )
    # ... and so does a group this process destroyed (rw.shutdown(), then rw.init() again).
    prefix = f"/rankwise/attempt_{env.restart_count}/init_{_destroyed['groups']}"
    return {"store": dist.PrefixStore(prefix, store)}
