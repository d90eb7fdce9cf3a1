"""Every rank draws a meta-built model's initial values from the same random state.

Each rank initialises the units (or tensor-parallel pieces) it keeps; the pieces fit together
only if every rank drew the same numbers. Two ways to agree:

- **default**: rank 0's generator state is broadcast and used for the initialisation; each
  rank's own generator is restored afterwards (building the model does not move the random
  stream the rest of the script sees);
- **exact** (``exact_init=True``): the ranks must already hold the same CPU generator state
  (seeded alike); that is checked, and the generator advances exactly as an eager build would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...diagnose import fingerprints
from ...errors import ConfigError


def get_state(device: torch.device) -> torch.Tensor:
    """The default generator's state for ``device`` (the CPU's for a CPU device)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _world(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _gathered(state: torch.Tensor, group: Any, comm_device: torch.device) -> list[torch.Tensor]:
    mine = state.to(comm_device)
    slots = [torch.empty_like(mine) for _ in range(_world(group))]
    with fingerprints.collective("all_gather", mine, label="random state", group=group):
        dist.all_gather(slots, mine, group=group)
    return [s.cpu() for s in slots]


def _check_same(state: torch.Tensor, group: Any, comm_device: torch.device, rank: int) -> None:
    states = _gathered(state, group, comm_device)
    odd = [r for r, s in enumerate(states) if not torch.equal(s, states[0])]
    if odd:
        raise ConfigError(
            f"exact_init=True needs the same random state on every rank, but rank(s) "
            f"{odd} differ from rank 0 (ranks of the group)",
            fix="seed every rank alike before building the model (torch.manual_seed(seed) "
            "on every rank), or leave exact_init out: rank 0's state is then used.",
            rank=rank,
        )


def _rank0(state: torch.Tensor, group: Any, comm_device: torch.device) -> torch.Tensor:
    flat = state.to(comm_device, copy=True)  # ``state`` is restored afterwards: not in place
    entry = fingerprints.record("broadcast", flat, label="random state", group=group,
                                extra="src=0")  # fmt: skip
    entry.watch(dist.broadcast(flat, group=group, group_src=0, async_op=True))
    entry.wait()
    return flat.to(state.device)


@contextlib.contextmanager
def agreed(exact: bool, device: torch.device, comm_device: torch.device,
           group: Any = None) -> Iterator[None]:  # fmt: skip
    """The block draws from one random state on every rank of ``group`` (see the module
    text); ``device``: whose generator the initialisation uses. Sync point: the ranks of
    ``group`` (one small collective)."""
    state = get_state(device)
    world = _world(group)
    if exact:
        if world > 1:
            _check_same(state, group, comm_device, dist.get_rank())
        yield
        return
    if world > 1:
        set_state(device, _rank0(state, group, comm_device))
    try:
        yield
    finally:
        set_state(device, state)
