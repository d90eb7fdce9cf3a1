"""Stage 3 on one machine: the parameters stored once per machine, in shared memory.

Stage 3 keeps 1/N of the parameters per rank and all-gathers a unit before it computes. Where
every rank is on this machine, they can keep the same 1/N each *inside one shared buffer*: each
unit's flat ``full`` buffer lives in a shared-memory file that every rank maps, and rank r's
shard is its own chunk of it. The machine then holds each parameter once, as N ranks holding a
shard each would, and every rank reads the whole unit where it lies: nothing is gathered, nothing
freed, no Gloo all-gather crosses a loopback socket (measured on the GPT-2 recipe: two gathers
per unit per step, about half of stage 3's cost over the step with no communication). The
memory is the same; the resident set counts the shared pages in every rank that reads them,
the proportional set size (PSS) splits them.

Who writes what: rank r writes only its chunk, and only in ``optimizer.step()`` and when a
state is loaded; every rank reads every chunk in forward, backward, ``state_dict()`` and
``full_parameters()``. Barriers on the gather group keep the two apart: one at the start of
every forward pass and of ``state_dict()``/``full_parameters()`` (whatever was written is
written), one at the start of ``step()`` and of a load (nobody reads any more), unless the
fence that ends a synchronised backward pass already said so.

Gradients: each unit's reduce-scatter goes through two rotating shared slots per rank
(``GradSlots``): the gradient is written straight into a slot, each rank sums its own chunk
over every rank's slot, and the slot is reused two units later, once a barrier says every
rank has summed from it. Each slot is sized for the largest unit it serves, so the full
gradient never exists at once: a rank holds two units' gradients where Gloo's reduce-scatter
holds one at a time (while it is reduced). The slots stay resident between steps: giving their
pages back after each pass (``madvise(MADV_REMOVE)``) and faulting them in again cost about
45 ms of a 600 ms GPT-2 step, measured interleaved.

Used for CPU units on a Gloo group whose ranks all map the same /dev/shm file, when some unit
is at least ``shared_reduce.MIN_BYTES``; otherwise (NCCL, several nodes, no room in /dev/shm,
a small model) stage 3 gathers through the group. The ranks agree (``shm_file.agree``).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ....diagnose import fingerprints
from ....errors import DistributedError
from ...buckets import Bucket
from ...ddp.node import shared_reduce, shm_file
from .shared import insisted

if TYPE_CHECKING:
    from ..shard_unit import FlatUnit

SLOTS = 2
"""Gradient slots per rank: unit p reuses unit p-2's, freed by unit p-1's barrier."""
_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class NodeShared:
    """The machine's one copy of a stage-3 model's parameters, and its gradient slots."""

    def __init__(self, group: dist.ProcessGroup, grads: GradSlots) -> None:
        self.group, self.grads = group, grads
        self.quiet = True
        """No rank has read the units since a barrier every rank passed after its reads (the
        fence of a synchronised backward pass): a write needs no barrier of its own."""

    def fence(self) -> _Fence:
        """End of a synchronised backward pass: the last unit's slot released on every rank
        (``ShardedDataParallel._finalize``). Sync point: all ranks."""
        return _Fence(self.grads._channel.submit(None), self)

    def before_read(self) -> None:
        """A forward, ``state_dict()`` or ``full_parameters()`` starts. Sync point: all ranks."""
        self.barrier()  # what a step or a load wrote is written on every rank
        self.quiet = False

    def before_write(self) -> None:
        """A step or a load is about to change this rank's chunk. Sync point: all ranks, unless
        every rank's reads ended at the last fence (a step after a synchronised backward)."""
        if not self.quiet:
            self.barrier()
        self.quiet = True

    def barrier(self) -> None:
        """Every rank is here: writes before it are seen by reads after it. Sync point: the
        ranks of the engine's group."""
        # The label says what the diagnosis names (``diagnose/causes``: a ZeRO-3 forward).
        label = "parameters of every unit (shared memory)"
        entry = fingerprints.record("barrier", label=label, group=self.group)
        entry.watch(dist.barrier(group=self.group, async_op=True))
        entry.wait()


class _Fence:
    """The fence's work; done, no rank reads the units until the next ``before_read``."""

    def __init__(self, work: shared_reduce.Work, node: NodeShared) -> None:
        self.work, self.node = work, node

    def wait(self, timeout: timedelta | None = None) -> bool:
        done = self.work.wait(timeout)
        if done:
            self.node.quiet = True
        return done


class GradSlots:
    """``SLOTS`` gradient buffers per rank in shared memory, reduced by the group's channel."""

    def __init__(self, engine: Any, arena: torch.Tensor, numels: list[int],
                 dtype: torch.dtype, group: dist.ProcessGroup) -> None:  # fmt: skip
        world = group.size()
        self.rank = group.rank()
        self.timeout = group._get_backend(torch.device("cpu")).options._timeout
        self._engine = engine
        """The engine: ``_next`` is how many units this backward pass has launched."""
        self._channel = shared_reduce._channel(group)
        self._views: list[list[torch.Tensor]] = []  # [s][r]: slot s of rank r
        start = 0
        for numel in numels:
            nbytes = numel * dtype.itemsize
            starts = [start + r * _aligned(nbytes) for r in range(world)]
            self._views.append([arena[a : a + nbytes].view(dtype) for a in starts])
            start += world * _aligned(nbytes)
        self._free = [threading.Event() for _ in range(SLOTS)]
        self._occupant: list[FlatUnit | None] = [None] * SLOTS  # reduced there, maybe unfinished
        for event in self._free:
            event.set()

    def buffer(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's gradient buffer: its slot when the slot can be waited for now (the unit
        launched just before this one's position has been), else a private one, copied into
        the slot at launch (a unit whose gradients start before the previous one's end)."""
        s = unit.position % SLOTS
        if self._engine._next + SLOTS - 2 >= unit.position:
            self._take(s)
            flat = self._views[s][self.rank][: unit.spec.padded]
            flat[sum(unit.spec.numels) :].zero_()  # the padding: a previous unit's values
            return flat
        return torch.zeros(unit.spec.padded, dtype=unit.dtype, device=unit.device)

    def reduce_scatter(self, unit: FlatUnit) -> shared_reduce.Work:
        """Sum the unit's gradient over the ranks; this rank's chunk of the sum lands in its
        slot (``unit.grad_full`` becomes that slot). Sync point: all ranks."""
        s, me = unit.position % SLOTS, self.rank
        mine = self._views[s][me][: unit.spec.padded]
        if unit.grad_full.data_ptr() != mine.data_ptr():
            self._take(s)
            mine.copy_(unit.grad_full)
            unit.grad_full = mine
        self._free[s].clear()
        self._occupant[s] = unit
        lo, hi = unit.lo, unit.hi
        views = [v[lo:hi] for v in self._views[s]]

        def reduce() -> Any:
            acc = views[me]
            for r, view in enumerate(views):
                if r != me:
                    acc.add_(view)
            return self._free[s].set  # at the next barrier: every rank has summed from it

        return self._channel.submit(reduce, early=True)

    def _take(self, s: int) -> None:
        """Slot ``s`` for a new unit: its last one's sum moved out (``finish_reduce``: the
        engine waits for no reduction during backward, so it may not have), and every rank
        done reading it."""
        last, self._occupant[s] = self._occupant[s], None
        # Launched and not finished yet: its sum is still in the slot. (A unit of an earlier
        # pass, finished, may hold a new buffer already: its first gradients of this pass.)
        if last is not None and last._reduce_entry is not None:
            last.finish_reduce()
        self._wait_free(s)

    def _wait_free(self, s: int) -> None:
        if not self._free[s].wait(self.timeout.total_seconds()):
            raise DistributedError(
                f"gradient slot {s} was not released within {self.timeout} (a rank stopped "
                "between two reductions of a backward pass)",
                fix="see the other ranks' errors; `rankwise diagnose` shows where each stopped.",
                rank=dist.get_rank(),
            )


def before_write(engine: Any) -> None:
    """A step or a load is about to write this rank's shards of ``engine`` (a ZeRO engine, or
    None): under stage 3 on one machine, wait until no rank reads them. Sync point: the
    engine's ranks (for such an engine)."""
    units = getattr(engine, "units", None)
    if units and units[0].node is not None:
        units[0].node.before_write()


def attach(engine: Any) -> NodeShared | None:
    """Move a stage-3 engine's units into shared memory, or None to gather through the group.
    Call once the shards hold their values. Sync point: the ranks of the engine's group."""
    units, enabled = engine.units, engine.shared_memory
    if engine.stage != 3 or not units or not units[0].communicates or enabled is False:
        return None
    fix = "leave shared_memory unset"
    if units[0].lane is not None or units[0].gather_lane is not None:
        return insisted("the job spans several nodes", fix) if enabled else None
    group = engine.process_group if engine.process_group is not None else dist.group.WORLD
    sizes = [Bucket(indices=(), offsets=(), numel=u.spec.padded, dtype=u.dtype, device=u.device)
             for u in units]  # fmt: skip
    why = shared_reduce.locally_impossible(sizes, group)
    if why is not None:
        return insisted(why, fix) if enabled else None
    if not shared_reduce.worth_sharing(sizes) and not enabled:
        return None  # every unit under 1 MiB: Gloo's round trips cost less than barriers
    starts, end = [], shm_file.TOKEN
    for b in sizes:
        starts.append(end)
        end += _aligned(b.nbytes)
    # Slot s serves the units at positions s, s + SLOTS, ...: sized for the largest of them.
    slot_numels = [max((units[u].spec.padded for u in engine._order[s::SLOTS]), default=0)
                   for s in range(SLOTS)]  # fmt: skip
    itemsize = units[0].dtype.itemsize
    total = end + group.size() * sum(_aligned(n * itemsize) for n in slot_numels)
    made = shm_file.create(total) if group.rank() == 0 else None
    arena = shm_file.agree(made, total, dist.get_process_group_ranks(group), group)
    if arena is None:
        why = f"not every rank could map a {total} byte file in {shm_file.SHM_DIR}"
        return (
            insisted(why, f"{fix}, or give the container more shared memory") if enabled else None
        )
    for unit, start, b in zip(units, starts, sizes, strict=True):
        unit.share(arena[start : start + b.nbytes].view(b.dtype))
    for position, u in enumerate(engine._order):
        units[u].position = position
    grads = GradSlots(engine, arena[end:], slot_numels, units[0].dtype, group)
    node = NodeShared(units[0].gather_group, grads)
    for unit in units:
        unit.node = node
    engine._shared = node  # its fence ends each synchronised backward pass
    node.barrier()  # every rank's chunk is in place before anyone reads the units
    return node
