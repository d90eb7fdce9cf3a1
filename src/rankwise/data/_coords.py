"""Where this process sits, for data partitioning, from ``runtime.coords()`` (the one lookup).

Partitioning needs no collective, so a loader built before ``rw.init()`` in a launched job still
splits the data by the launcher's RANK/WORLD_SIZE instead of silently giving every rank all of it.
Helpers that *do* communicate call ``require_group`` so the same mistake fails loudly there.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import runtime
from ..errors import ConfigError, RuntimeStateError


def coords() -> tuple[int, int]:
    """(rank, world_size) of this process among the ranks that read different data: under
    ``rw.init(mesh=...)`` its coordinate and size along the data dimension (the ranks of one
    tensor-parallel or pipeline group read the same batches), else its global ones."""
    c = runtime.coords()
    return c.data or (c.rank, c.world_size)


def resolve(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Fill in defaults and check ``0 <= rank < num_replicas``, repeating the user's values."""
    default_rank, default_world = coords()
    world = default_world if num_replicas is None else num_replicas
    r = default_rank if rank is None else rank
    if not isinstance(world, int) or world < 1:
        raise ConfigError(
            f"num_replicas={num_replicas!r} must be a positive integer",
            fix="leave num_replicas unset (the runtime's world size is used) or pass e.g. 2.",
        )
    if not isinstance(r, int) or not 0 <= r < world:
        raise ConfigError(
            # torch's DistributedSampler wording first (code and tests match it), then ours
            f"Invalid rank {r}, rank should be in the interval [0, {world - 1}]: "
            f"rank={r!r} is out of range for num_replicas={world}",
            fix="leave rank unset (the runtime's rank is used) or pass a rank below num_replicas.",
        )
    return r, world


def require_group(what: str) -> int:
    """The world size for a collective; an error when launched but not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    world = coords()[1]
    if world > 1:
        raise RuntimeStateError(
            f"{what} needs the process group, but this process is rank {coords()[0]} of "
            f"{world} and rankwise is not initialised",
            fix="call `rw.init()` at the start of the program, on every rank.",
        )
    return 1
