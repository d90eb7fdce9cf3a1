"""What moves between ranks for the replicas: byte buffers on a group of their own (Gloo, on the
CPU), so a copy in flight in the background never queues behind the training's collectives.
Sizes travel first as int64 tensors and are checked before anything is allocated; nothing is
ever unpickled (peers are untrusted)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..job.process_group import new_group
from .plan import Held, holders, source

MAX_ROWS = 256
"""Replica files one host's listing reports (a host keeps two steps of its ranks' and their
buddies' copies: far fewer)."""


def make_group() -> Any:
    """A Gloo group of every rank, for the replicas alone, with the job's timeout (torch's
    default is 30 minutes). Sync point: all ranks."""
    return new_group(backend="gloo")


def _sizes(mine: int, dst: int, src: int, group: Any) -> int:
    out, got = torch.tensor([mine], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for req in (dist.isend(out, dst, group=group), dist.irecv(got, src, group=group)):
        req.wait()
    return int(got.item())


def _check_size(size: int, limit: int, src: int, what: str) -> None:
    if not 0 <= size <= limit:
        raise DistributedError(
            f"replicas: rank {src} announced a {what} of {size} bytes (limit {limit})",
            fix="check that every rank runs the same script and model; a rank that announces "
            "another size is not one of this job's.",
            rank=dist.get_rank(),
        )


def swap(buf: torch.Tensor, dst: int, src: int, group: Any, limit: int) -> torch.Tensor:
    """Send ``buf`` to ``dst`` while receiving ``src``'s (at most ``limit`` bytes)."""
    size = _sizes(buf.numel(), dst, src, group)
    _check_size(size, limit, src, "replica")
    got = torch.empty(size, dtype=torch.uint8)
    for req in (dist.isend(buf, dst, group=group), dist.irecv(got, src, group=group)):
        req.wait()
    return got


def inventories(mine: list[Held], group: Any) -> list[list[Held]]:
    """Every rank's listing of its host's folder, in rank order. Sync point: all ranks."""
    rows = mine[-MAX_ROWS:]
    flat = torch.full((1 + 3 * MAX_ROWS,), -1, dtype=torch.int64)
    flat[0] = len(rows)
    for i, h in enumerate(rows):
        flat[1 + 3 * i : 4 + 3 * i] = torch.tensor([h.rank, h.step, h.world])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, flat, group=group)
    result = []
    for t in out:
        n = max(0, min(int(t[0]), MAX_ROWS))
        vals = t[1 : 1 + 3 * n].view(n, 3).tolist()
        result.append([Held(r, s, w) for r, s, w in vals if r >= 0 and s >= 0 and w > 0])
    return result


def move(held: list[list[Held]], step: int, world: int, read: Any, group: Any,
         limit: int) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """This rank's source state at ``step`` (read locally or received from the rank whose host
    holds it) and whether its RNG is to be restored. ``read(Held)`` reads this host's folder.
    Pairs are served in rank order, the same on every rank: no cycle can wait on itself."""
    me, new_world = dist.get_rank(group), dist.get_world_size(group)
    who = holders(held, step, world)
    mine: torch.Tensor | None = None
    for j in range(new_world):
        old, _ = source(j, world)
        h = who[old]
        if me == h:
            buf = read(Held(old, step, world))
            if j == me:
                mine = buf
            else:
                send_bytes(buf, j, group)
        elif me == j:
            mine = recv_bytes(h, group, limit, "replica")
    assert mine is not None  # every j was served above
    return mine, source(me, world)[1]


def send_bytes(buf: torch.Tensor, dst: int, group: Any) -> None:
    """``buf`` to ``dst``, its size first."""
    dist.send(torch.tensor([buf.numel()], dtype=torch.int64), dst, group=group)
    dist.send(buf, dst, group=group)


def recv_bytes(src: int, group: Any, limit: int, what: str = "buffer") -> torch.Tensor:
    """A buffer from ``src`` (``send_bytes``), its announced size checked against ``limit``."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    _check_size(int(size.item()), limit, src, what)
    out = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(out, src, group=group)
    return out

