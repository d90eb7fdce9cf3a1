"""All-reduce of gradient buckets through shared memory, when every rank is on this machine.

Gloo moves a CPU all-reduce through loopback TCP: every byte is copied into a socket, out of it
on the other side, then summed. Ranks that share a machine can read each other's buckets
instead. Every rank's flat bucket buffers live in one shared-memory file, a slot per rank,
and ``.grad`` is a view of the rank's own slot. For each bucket:

1. every rank has put its gradients (already divided by the world size) in its slot; a barrier;
2. rank r sums chunk r of the bucket over all slots, into its own slot (a reduce-scatter by
   reading, not sending), and copies that sum into chunk r of every other slot (an all-gather
   by writing); a barrier: every slot, and with it every rank's ``.grad``, holds the average.

Only rank r reads or writes chunk r of any slot between the two barriers, so nothing races.
Each chunk is summed once and copied, so every replica holds bit-identical gradients. The
barrier of step 2 is the next bucket's barrier of step 1 (``_Channel``), and the last one
(``fence``) keeps a rank from writing its slot again (the next step's gradients, ``zero_grad``,
clipping) before the others' sums are in it: n buckets, n + 1 barriers. (Copying by writing
rather than reading saves a barrier: a rank that read the others' sums would need one more to
know they were all read before anyone writes a slot again.)

Synchronisation stays the engine's: the barriers are Gloo sends and receives on a process group
of their own, run by one worker thread in the order the reducer launched the buckets, so a rank
that dies or stalls fails them like any collective (timeouts, the stall report). The file is
created by ``posix_fallocate`` (a full /dev/shm fails here, not later with SIGBUS) and unlinked
as soon as every rank has mapped it, whatever happens (``shm_file``): nothing is left behind in
/dev/shm.

Used for CPU buckets on a Gloo group whose ranks all see the same /dev/shm file; otherwise
(NCCL, ranks on several machines, no room) buckets go through the group's all-reduce. The
ranks agree on the choice with one all-reduce, so they never mix the two.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ....comm.groups import among
from ....errors import ConfigError
from ...buckets import Bucket
from . import shm_file
from .shm_file import SHM_DIR

MIN_BYTES = 1024 * 1024
"""Smaller buckets go through the group's all-reduce: below about 1 MiB one Gloo round trip
costs less than a shared bucket's barriers and the worker thread's wake-ups (measured at 2
ranks, one bucket and its fence: 0.85 ms against 2.0 ms for 1 KiB, about even at 1 MiB, 5.7
against 3.3 ms at 4 MiB)."""
_ALIGN = 64  # each bucket starts on its own cache line
_TOKEN = shm_file.TOKEN
_BARRIER_TAG = 0  # the barrier group carries nothing else


class Work:
    """What ``all_reduce`` and ``fence`` return: a ``Work``-like handle (``wait``,
    ``is_completed``) that the fingerprint watchdog polls like Gloo's own."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; raise what the worker raised. False when ``timeout`` passed."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self._error is not None:
            raise self._error
        return True


Finish = Callable[[], None] | None
"""What a job leaves to run once every rank has done its part (the next barrier), if anything."""


class _Channel:
    """One Gloo group for the barriers and one worker thread that runs the jobs in order.

    One per process group, shared by every wrapper on it: creating a group costs sockets that
    torch does not give back, and one queue keeps the barriers in launch order across wrappers
    (as the process group itself does for their all-reduces).

    Barriers are pipelined: the barrier that says bucket k+1 is in every slot also says that
    bucket k's chunks are summed and copied, so bucket k's ``Work`` completes when the next
    job starts. A pass of n shared buckets costs n + 1 barriers (the last one the fence's),
    not 2n. Every rank runs the same jobs, so all pipeline alike.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        ranks = dist.get_process_group_ranks(group)
        self.barriers = among(ranks, group, backend="gloo", timeout=timeout)
        self._me, self._world = self.barriers.rank(), self.barriers.size()
        self._sent, self._got = torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: tuple[Finish, Work] | None = None  # reduced here, maybe not everywhere
        threading.Thread(target=self._serve, name="rankwise-shared-reduce", daemon=True).start()

    def submit(self, reduce: Callable[[], Finish] | None, early: bool = False) -> Work:
        """Queue a bucket (``reduce`` does this rank's part and returns what to run, if
        anything, once every rank has done its part: at the next job's barrier), or with None
        the fence. ``early``: the work completes once this rank's part is done (a
        reduce-scatter: ZeRO-3's ``comm/node_shared``). What runs after the barrier must not
        read another rank's slot: no barrier follows it to say the reads are over."""
        work = Work()
        self.jobs.put((reduce, work, early))
        return work

    def barrier(self) -> None:
        """Every rank of the group is here: a dissemination barrier of Gloo sends and receives
        (ceil(log2 W) rounds), which this thread drives itself. ``dist.barrier`` hands its
        work to a Gloo worker thread: one more thread to wake per barrier, and with the ranks'
        compute on every core such wake-ups wait for a core (``benchmarks/ddp_wait.py``'s
        tail). A receive fails like any collective: at the group's timeout, or with the error
        of a peer that is gone."""
        me, world, step = self._me, self._world, 1
        while step < world:
            sent = self.barriers.send([self._sent], (me + step) % world, _BARRIER_TAG)
            got = self.barriers.recv([self._got], (me - step) % world, _BARRIER_TAG)
            sent.wait()
            got.wait()
            step *= 2

    def _serve(self) -> None:
        while True:
            reduce, work, early = self.jobs.get()
            try:
                self._run(reduce, work, early)
            except BaseException as exc:  # handed to whoever waits on the work(s)
                if self.pending is not None:
                    self.pending[1]._finish(exc)
                    self.pending = None
                work._finish(exc)

    def _run(self, reduce: Callable[[], Finish] | None, work: Work, early: bool) -> None:
        # This bucket is in every slot; the pending one is reduced on every rank. For the
        # fence with nothing pending: every rank is here all the same.
        self.barrier()
        if self.pending is not None:
            finish, done = self.pending
            self.pending = None
            if finish is not None:
                finish()
            done._finish()  # a no-op for an early work, already finished
        if reduce is None:
            work._finish()  # the fence: every slot is complete, no rank touches another's
            return
        self.pending = (reduce(), work)
        if early:
            work._finish()


_CHANNELS: dict[int, tuple[dist.ProcessGroup, _Channel]] = {}
"""id(group) -> (group, its channel). The group is kept so that its id is never reused."""


def _channel(group: dist.ProcessGroup) -> _Channel:
    """The group's channel, made on first use. Sync point (first use): the group's ranks."""
    found = _CHANNELS.get(id(group))
    if found is None:
        found = _CHANNELS[id(group)] = (group, _Channel(group))
    return found[1]


class SharedBuckets:
    """The shared-memory slots of a reducer's buckets, reduced by its group's channel."""

    def __init__(
        self,
        arena: torch.Tensor,
        layout: dict[int, tuple[Bucket, int]],
        slot_bytes: int,
        rank: int,
        group: dist.ProcessGroup,
    ) -> None:
        self.rank, self.world = rank, group.size()
        self._channel = _channel(group)
        # views[b][r]: bucket b's flat buffer in rank r's slot
        self._views = {
            b: [
                arena[start : start + bucket.nbytes].view(bucket.dtype)
                for start in (_TOKEN + r * slot_bytes + off for r in range(self.world))
            ]
            for b, (bucket, off) in layout.items()
        }
        self._bounds = {
            b: [bucket.numel * r // self.world for r in range(self.world + 1)]
            for b, (bucket, _) in layout.items()
        }

    def holds(self, b: int) -> bool:
        """Bucket ``b`` is reduced here (large enough to gain from it)."""
        return b in self._views

    def flat(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s flat buffer in this rank's slot."""
        return self._views[b][self.rank]

    def all_reduce(self, b: int) -> Work:
        """Start summing bucket ``b`` over the ranks, in place. Sync point: all ranks."""
        return self._channel.submit(lambda: self._reduce(b))

    def fence(self) -> Work:
        """Start the end-of-pass barrier (see the module docstring). Sync point: all ranks."""
        return self._channel.submit(None)

    def _reduce(self, b: int) -> None:
        """Sum this rank's chunk of bucket ``b`` over all slots (every slot is filled) and copy
        the sum into that chunk of every other slot (no rank but this one touches the chunk
        until the next barrier)."""
        views, bounds, me = self._views[b], self._bounds[b], self.rank
        lo, hi = bounds[me], bounds[me + 1]
        acc = views[me][lo:hi]
        for r, view in enumerate(views):
            if r != me:
                acc.add_(view[lo:hi])
        self._combine(acc)
        for r, view in enumerate(views):
            if r != me:
                view[lo:hi].copy_(acc)

    def _combine(self, chunk: torch.Tensor) -> None:
        """What more the chunk's sum needs before it is copied out (nothing, on one node)."""


def attach(
    buckets: Sequence[Bucket],
    group: dist.ProcessGroup | None,
    enabled: bool | None,
) -> SharedBuckets | None:
    """Shared-memory buckets for this group, or None to use its all-reduce.

    ``enabled``: None decides (on when possible), False never, True insists (an error says
    why it cannot be). Sync point: all ranks of ``group`` (unless the answer is plain locally).
    """
    group = group if group is not None else dist.group.WORLD
    why_not = locally_impossible(buckets, group) if enabled is not False else "disabled"
    if why_not is not None:
        if enabled:
            raise ConfigError(
                f"shared_memory_reduce=True, but {why_not}",
                fix="leave shared_memory_reduce unset: it is used whenever it can be.",
            )
        return None
    layout, slot_bytes = slot_layout(buckets)
    if not layout:
        return None  # every bucket is small: the same answer on every rank, no need to agree
    ranks = dist.get_process_group_ranks(group)
    me = group.rank()
    total = _TOKEN + group.size() * slot_bytes
    made = shm_file.create(total) if me == 0 else None
    arena = shm_file.agree(made, total, ranks, group)
    if arena is None:
        if enabled:
            raise ConfigError(
                f"shared_memory_reduce=True, but not every rank could map a {total} byte file "
                f"in {SHM_DIR} (ranks on different machines, or {SHM_DIR} too small)",
                fix="leave shared_memory_reduce unset, or give the container more shared "
                "memory (docker run --shm-size=...).",
            )
        return None
    return SharedBuckets(arena, layout, slot_bytes, me, group)


def locally_impossible(buckets: Sequence[Bucket], group: dist.ProcessGroup) -> str | None:
    """Why this rank can tell by itself that shared memory is out (same on every rank)."""
    if group.size() < 2 or not buckets:
        return "there is no other rank to reduce with"
    if any(b.device.type != "cpu" for b in buckets):
        return "the gradients are not on the CPU"
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return "the process group has no CPU backend"
    if not isinstance(backend, dist.ProcessGroupGloo):
        return f"the process group's CPU backend is {type(backend).__name__}, not Gloo"
    return None


def worth_sharing(buckets: Sequence[Bucket]) -> bool:
    """Some bucket is large enough to go through shared memory where ranks share a machine."""
    return any(b.nbytes >= MIN_BYTES for b in buckets)


def slot_layout(buckets: Sequence[Bucket]) -> tuple[dict[int, tuple[Bucket, int]], int]:
    """{bucket index: (bucket, byte offset in a slot)} for the buckets worth sharing, and the
    slot's size (offsets and size cache-line aligned)."""
    layout, end = {}, 0
    for b, bucket in enumerate(buckets):
        if bucket.nbytes >= MIN_BYTES:
            layout[b] = (bucket, end)
            end += -(-bucket.nbytes // _ALIGN) * _ALIGN
    return layout, end
