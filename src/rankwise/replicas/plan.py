"""The pure decisions of in-memory replicas: who holds whose copy, which step to resume, who
sends what to whom, and the accumulation that keeps the global batch. No torch, no I/O.

- **Buddy**: rank r's copy goes to ``(r + local_world) % world``, the same local rank on the
  next node, so it lives on another host; on one node, to the next rank.
- **Step**: the newest step for which every rank of the world that wrote it has a copy
  somewhere among the survivors (own or buddy's).
- **Sources**: new rank j takes old rank j's state (its RNG and data position included); a
  rank beyond the old world (a grown job) takes old rank ``j % old_world``'s model, optimizer
  and position and keeps its own RNG, as ``rw.load_checkpoint`` does at a larger world.
- **Global batch**: ``accumulation = global_batch / (world * micro_batch)``, refused when not a
  whole number.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


def buddy_of(rank: int, world: int, local_world: int) -> int:
    """The rank that keeps ``rank``'s copy: the same local rank on the next node."""
    shift = local_world if world > local_world else 1
    return (rank + shift) % world


def buddy_source(rank: int, world: int, local_world: int) -> int:
    """The rank whose copy ``rank`` keeps (the inverse of ``buddy_of``)."""
    shift = local_world if world > local_world else 1
    return (rank - shift) % world


@dataclass(frozen=True)
class Held:
    """One replica on some host: old rank ``rank``'s state at ``step`` of a ``world``-rank job."""

    rank: int
    step: int
    world: int


def choose(held: list[list[Held]]) -> tuple[int, int] | None:
    """``(step, old world)`` of the newest step every old rank's state exists for in
    ``held`` (one list per new rank: what its host's folder holds); None when none is whole."""
    seen: dict[tuple[int, int], set[int]] = {}
    for items in held:
        for h in items:
            if 0 <= h.rank < h.world:
                seen.setdefault((h.step, h.world), set()).add(h.rank)
    whole = [key for key, ranks in seen.items() if len(ranks) == key[1]]
    return max(whole) if whole else None


def holders(held: list[list[Held]], step: int, world: int) -> dict[int, int]:
    """Old rank -> the lowest new rank whose host holds its state at ``step``."""
    out: dict[int, int] = {}
    for new_rank, items in enumerate(held):
        for h in items:
            if h.step == step and h.world == world:
                out.setdefault(h.rank, new_rank)
    return out


def source(new_rank: int, old_world: int) -> tuple[int, bool]:
    """(the old rank whose state ``new_rank`` loads, whether it takes that rank's RNG too)."""
    return new_rank % old_world, new_rank < old_world


def accumulation_for(global_batch: int, world: int, micro_batch: int) -> int:
    """Micro-batches per step that keep ``global_batch`` at ``world`` ranks of ``micro_batch``."""
    per_step = world * micro_batch
    if global_batch % per_step:
        raise ConfigError(
            f"replicas: the global batch {global_batch} cannot be kept at {world} rank(s) of "
            f"batch {micro_batch}: {global_batch} is not a multiple of {world} x {micro_batch} "
            f"= {per_step}",
            fix="choose a global batch that every world size between --nnodes MIN and MAX "
            "divides (times the per-rank batch), e.g. a multiple of their least common "
            "multiple, or a per-rank batch that divides it.",
        )
    return global_batch // per_step
