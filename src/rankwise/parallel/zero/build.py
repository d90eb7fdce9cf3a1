"""Building the sharded engine's units: from an eagerly built model, or from a meta one.

An eagerly built model is packed unit by unit (``FlatUnit._pack``): each unit's parameters
move into its flat buffer, rank 0's values are broadcast for that unit alone, and stage 3
keeps only this rank's shard before the next unit starts, so preparing never holds a second
copy of the model. A model built on the meta device starts with empty units; each module is
then initialised in ``model.apply``'s order (``parallel/deferred``) and its parameters handed to
their units (``FlatUnit.fill``) once no later module writes them, which keep this rank's part: the model never exists whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm.groups import among
from ...errors import ConfigError
from .. import deferred
from ..agreement import broadcast_tensors
from ..buckets import assign_buckets
from .comm import hier_comm, node_shared, shared
from .layout import layout, module_units, split_by_group
from .shard_unit import FlatUnit
from .wrap import WrapPolicy, resolve

if TYPE_CHECKING:
    from .engine_view import ShardedEngine as ShardedDataParallel


def build_units(
    engine: ShardedDataParallel,
    bucket_cap_mb: float,
    unit_numel: int,
    wrap: WrapPolicy,
    group_of: list[int | None],
    device: torch.device | None,
    broadcast: bool,
) -> None:
    """``engine.units`` (+ ``unit_group``, ``_unit_modules``, ``_where``, ``_order``).
    Sync point: the ranks of the engine's group (stage 3's gather group; ``broadcast``)."""
    numels = [p.numel() for p in engine.params]
    if engine.stage < 3:
        buckets = assign_buckets(engine.params, bucket_cap_mb)
        pairs: list[tuple[Any, list[int]]] = [(None, list(b.indices)) for b in buckets]
    else:
        policy = resolve(wrap, engine._root)
        pairs = module_units(engine._root, engine.params, unit_numel, policy)
        pairs = [(m, g) for m, g in pairs if g]
    pieces = split_by_group(pairs, group_of)
    modules = [m for m, _, _ in pieces]
    engine.unit_group = [k for _, _, k in pieces]
    gathers = gather_group(engine)
    lanes = hier_comm.lanes(
        engine.process_group, engine.world_size, engine.stage, engine.hierarchical_reduce
    )
    specs = layout(numels, [g for _, g, _ in pieces], engine.world_size)
    engine.units = [
        FlatUnit(
            spec, [engine.params[i] for i in spec.indices], number=n, stage=engine.stage,
            rank=engine.rank, group=engine.process_group, gather_group=gathers, device=device,
            broadcast=broadcast,
        )
        for n, spec in enumerate(specs)
    ]  # fmt: skip
    for unit in engine.units:
        unit.lane, unit.gather_lane = lanes
    engine._shared = shared.attach(engine)  # stage 1 on one machine: shared-memory slots
    engine._unit_modules = modules
    engine._where = [(0, 0)] * len(engine.params)
    for u, unit in enumerate(engine.units):
        for k, i in enumerate(unit.spec.indices):
            engine._where[i] = (u, k)
    # Reductions are issued strictly in this order on every rank: buckets complete in
    # bucket order; stage 3 units complete in reverse forward order, the root's last.
    n = len(engine.units)
    roots = [u for u in range(n) if modules[u] is engine._root]
    inner = [u for u in range(n - 1, -1, -1) if modules[u] is not engine._root]
    engine._order = list(range(n)) if engine.stage < 3 else inner + roots


def fill(engine: ShardedDataParallel, how: deferred.DeferredInit | None, device: Any) -> None:
    """Every unit's values: rank 0's (eager build) or initialised here (meta); then stage 3's
    units move into shared memory where every rank is on this machine (``node_shared``).
    Sync point: the ranks of the engine's group."""
    if how is None:
        broadcast_the_rest(engine)
    else:
        fill_from_meta(engine, how, device)
    node_shared.attach(engine)


def gather_group(engine: ShardedDataParallel) -> Any:
    """Stage 3 gathers parameters on a group of their own: gathers (hook order) and gradient
    reductions (unit order) are each ordered alike on every rank, their interleaving is not.
    Agreed among this group's ranks alone (``use_local_synchronization``): a mesh's data
    groups each make one, and a world-wide new_group would pair them and hang.
    Sync point: the ranks of ``process_group`` (stage 3)."""
    group = engine.process_group
    if engine.stage < 3 or engine.world_size == 1:
        return group
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return among(ranks, group, backend=dist.get_backend(group))


def broadcast_the_rest(engine: ShardedDataParallel) -> None:
    """Rank 0's frozen parameters and buffers (the units broadcast their own). Sync point:
    the ranks of the engine's group."""
    if engine.world_size == 1:
        return
    mine = {id(p) for p in engine.params}
    rest = [p.detach() for p in engine._root.parameters() if id(p) not in mine]
    broadcast_tensors(rest + [b.detach() for b in engine._root.buffers()], engine.process_group)


def fill_from_meta(
    engine: ShardedDataParallel, how: deferred.DeferredInit, device: torch.device
) -> None:
    """Initialise the meta-built model module by module, each trainable parameter's values
    going to its unit (this rank's part kept), everything else to ``device``.
    Sync point: the ranks of the engine's group (the random state is agreed first)."""
    where = {id(p): engine._where[i] for i, p in enumerate(engine.params)}
    build = how.build_device(device)
    with deferred.agreed(how.exact, build, device, engine.process_group):
        for _, tensors in deferred.walk(engine._root, how, device):
            rest = []
            for t in tensors:
                if id(t) in where:
                    u, k = where[id(t)]
                    engine.units[u].fill(k, t)
                else:
                    rest.append(t)
            deferred.to_device(rest, device)
    missing = [engine.names[engine.units[u].spec.indices[k]]
               for u in range(len(engine.units)) for k in engine.units[u].unfilled]  # fmt: skip
    if missing:
        raise ConfigError(f"parameters left on the meta device: {missing[:5]}",
                          fix="report this: every meta module should have been built.")  # fmt: skip


def check_one_dtype(names: list[str], params: list[nn.Parameter], rank: int) -> None:
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        first = {}
        for n, p in zip(names, params, strict=True):
            first.setdefault((p.dtype, p.device), n)
        shown = ", ".join(f"{n} ({d}, {dev})" for (d, dev), n in first.items())
        raise ConfigError(
            f"the trainable parameters mix dtypes/devices: {shown}; one flat shard layout "
            "holds one dtype on one device",
            fix="cast the model to one dtype (model.float()) and move it to one device before "
            "wrapping; use autocast for mixed precision.",
            rank=rank,
        )
