"""Stage 1's gradient all-reduce through shared memory, where every rank is on this machine.

Stage 1 keeps every rank's whole averaged gradient, as DDP does, so on one machine it reduces
the way DDP does (``parallel/ddp/node/shared_reduce.py``): each unit's flat gradient buffer is
this rank's slot of one shared-memory file; every rank sums its chunk by reading the others'
slots, then copies that sum into the others' slots. Through Gloo the buffer
crossed a loopback socket: measured on the GPT-2 recipe, stage 1's backward took 40 ms more
than the same step with no communication. Each synchronised backward pass ends with the
channel's fence (``ShardedDataParallel._finalize``), so no rank writes its slot again before
every sum is in it.

Stages 2 and 3 free each unit's full gradient as soon as it is reduced and keep only the
shard: a slot per unit would hold the whole gradient for good, so they keep Gloo's
reduce-scatter. A job over several nodes (``hier_comm`` lanes), NCCL, or a full /dev/shm keep
Gloo's all-reduce too (the ranks agree, as DDP's do).
"""

from __future__ import annotations

from typing import Any

from ....errors import ConfigError
from ...buckets import Bucket
from ...ddp.node import shared_reduce


def attach(engine: Any) -> Any:
    """The units' shared gradient slots (``SharedBuckets``), or None, for a
    ``ShardedDataParallel`` being built. Each unit reduced there gets ``unit.shared = (buckets,
    index)``. Sync point: the engine's group (stage 1)."""
    units = engine.units
    if engine.stage != 1 or not units or not units[0].communicates or units[0].lane is not None:
        if engine.shared_memory and engine.stage == 2:
            insisted("stage 2 frees each unit's full gradient once reduced: it keeps Gloo's "
                     "reduce-scatter", "use stage=1 or 3 with shared_memory=True")  # fmt: skip
        elif engine.shared_memory and engine.stage == 1 and units and units[0].lane is not None:
            insisted("the job spans several nodes", "leave shared_memory unset")
        return None
    buckets = [Bucket(indices=(), offsets=(), numel=u.spec.padded, dtype=u.dtype, device=u.device)
               for u in units]  # fmt: skip
    shared = shared_reduce.attach(buckets, engine.process_group, engine.shared_memory)
    if shared is not None:
        for b, unit in enumerate(units):
            if shared.holds(b):
                unit.shared = (shared, b)
    return shared


def insisted(why: str, fix: str) -> None:
    """``ShardedDataParallel(shared_memory=True)`` where it cannot be: say why."""
    raise ConfigError(f"shared_memory=True, but {why}", fix=f"{fix}.")
