"""The reducer: gradients into flat buckets, one async all-reduce per bucket, all done by step().

How one synchronised backward pass goes:

1. The first parameter hook of the backward pass decides whether this pass synchronises (no
   ``no_sync()``, ``require_backward_grad_sync`` set) and queues ``_finalize`` to run when
   autograd has finished the whole pass.
2. Every parameter's ``post_accumulate_grad`` hook copies its gradient, already divided by the
   world size (one fused pass), into its slot of its bucket's flat buffer and makes ``.grad`` a
   view of that slot: the averaged result lands in ``.grad`` without a copy back.
3. When a bucket's last gradient arrives, its all-reduce starts asynchronously, while autograd
   goes on computing earlier layers. Buckets are launched strictly in bucket order, so every rank
   issues the same collectives in the same order even if hooks fire in a different order.
4. ``_finalize`` (end of backward) deals with parameters that got no gradient, waits for every
   all-reduce and leaves averaged gradients in ``.grad``, so an unchanged ``optimizer.step()``
   works.

"Used" accumulates over the ``no_sync()`` passes since the last synchronised one (torch's
``local_used_map``): a parameter that got a gradient in any of them holds a local gradient that
must be averaged, even if the final micro-batch did not touch it on any rank. Otherwise one
replica would step with it and another without (docs/pitfalls.md: replicas that diverge).

A communication hook (``register_comm_hook``, torch's signature) replaces the all-reduce of
each bucket: the bucket then holds the plain local sum, as in torch, and the hook divides.

Sparse gradients travel alone, at the end of backward (``sparse.py``). Reentrant activation
checkpointing splits a pass over nested autograd graph tasks, and ``static_graph`` lets a
gradient arrive more than once (``passes.py``).

At world size 1 nothing is copied or sent, but the bookkeeping still runs, so a parameter that
never gets a gradient is reported on a laptop just as it would be on 64 GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils.weak import WeakIdKeyDictionary

from ....diagnose import fingerprints
from ....timing import clock as timing
from ...buckets import Bucket
from .. import compression as comp
from ..comm_hooks import GradBucket, check_future
from ..node.shared_reduce import SharedBuckets
from . import end_of_pass, passes
from .grad_views import copy_higher_order, grad_view, reducible_in_place

_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> the hook handle of the reducer that averages it. Wrapping a module again (say
after freezing a layer) hands its parameters to the new wrapper; the old hook is removed so
that two reducers never fight over one gradient."""


class Reducer:
    """Averages the gradients of ``params`` over the process group during backward.

    ``should_sync()`` is asked once per backward pass, when its first hook fires.
    Sync point: all ranks, in every synchronised backward pass.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        buckets: Sequence[Bucket],
        *,
        group: dist.ProcessGroup | None,
        world_size: int,
        rank: int,
        find_unused_parameters: bool,
        compression: str | torch.dtype | None,
        should_sync: Callable[[], bool],
        shared: SharedBuckets | None = None,
        static_graph: bool = False,
        sparse: Sequence[bool] | None = None,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.buckets = list(buckets)
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.find_unused_parameters = find_unused_parameters
        self.should_sync = should_sync
        self.communicates = world_size > 1
        self._is_sparse = list(sparse) if sparse is not None else [False] * len(self.params)
        self._sparse = [i for i, s in enumerate(self._is_sparse) if s]
        self._bucket_of = [-1] * len(self.params)  # -1: a sparse gradient, in no bucket
        for b, bucket in enumerate(self.buckets):
            for i in bucket.indices:
                self._bucket_of[i] = b
        self._sizes = [len(b.indices) for b in self.buckets]
        self.shared = shared  # buckets in shared memory (shared_reduce.py), or None
        self._allocate(comp.wire_dtype(compression))
        self._scale = 1.0 / world_size
        self._comm_hook: tuple[Any, Callable[..., torch.futures.Future]] | None = None
        self._used = [False] * len(self.params)  # since the last synchronised pass
        # bucket -> the gradient all-reduced where autograd left it (see _make_hook), this pass
        self._in_place: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.started = False  # a backward pass has run (static graph must be set before)
        self.counts = passes.ArrivalCounts(len(self.params)) if static_graph else None
        self.order: list[int] = []  # the last synchronised pass's gradient-ready order
        self.last_used = [False] * len(self.params)  # ... and which parameters it used
        self.times: dict[str, int] = {}  # the last synchronised pass's host times (ns)
        self.on_pass_end: Callable[[], None] | None = None  # after each synchronised pass
        self.forward_in_backward = False  # the last forward was a reentrant recomputation
        self._reset()
        self._handles: list[Any] = []
        self._install_hooks()

    def _install_hooks(self) -> None:
        self.remove_hooks()
        for i, p in enumerate(self.params):
            previous = _OWNER.get(p)
            if previous is not None:
                previous.remove()
            _OWNER[p] = handle = p.register_post_accumulate_grad_hook(self._make_hook(i))
            self._handles.append(handle)

    def set_static_graph(self) -> None:
        """Gradients may arrive several times per pass, as often as in the first one."""
        self.counts = passes.ArrivalCounts(len(self.params))

    def set_comm_hook(self, state: Any, hook: Callable[..., torch.futures.Future]) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket (gradients summed, not averaged)."""
        self._comm_hook = (state, hook)
        self._scale = 1.0
        for b in range(len(self._flat)):  # a hook's GradBucket reads every flat buffer
            self._flat_of(b)
        self._install_hooks()  # each hook decides once whether its bucket reduces in place

    def _allocate(self, wire: torch.dtype | None) -> None:
        """Flat buffers (and gradient views into them), only when there is someone to talk to.

        A bucket of one gradient gets its buffer only when it needs one (``_flat_of``): its
        gradient is usually reduced where autograd left it, and the buffer would sit unused.
        """
        self._flat: list[torch.Tensor | None] = []
        self._wire: list[torch.Tensor | None] = []
        self._views: list[torch.Tensor | None] = [None] * len(self.params)
        self._solo: list[bool] = []  # one gradient, sent as it is: reducible in place
        if not self.communicates:
            return
        for b, bucket in enumerate(self.buckets):
            use_wire = comp.compresses(bucket.dtype, wire)
            # In shared memory, every gradient must be in this rank's slot for others to read.
            alone = len(bucket.indices) == 1 and not self._held(b)
            self._solo.append(alone and not use_wire)
            self._flat.append(None)
            if not self._solo[b]:
                self._flat_of(b)
            self._wire.append(comp.wire_buffer(self._flat_of(b), wire) if use_wire else None)

    def _flat_of(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s flat buffer, made (with its gradient views) on first use."""
        flat = self._flat[b]
        if flat is None:
            bucket = self.buckets[b]
            if self._held(b):
                flat = self.shared.flat(b)  # type: ignore[union-attr]
            else:
                flat = torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device)
            self._flat[b] = flat
            for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
                self._views[i] = grad_view(flat, offset, self.params[i])
        return flat

    def _slot(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s slot in its bucket's flat buffer."""
        if self._views[i] is None:
            self._flat_of(self._bucket_of[i])
        return self._views[i]  # type: ignore[return-value]

    # -- the hot path: one call per parameter per backward pass; keep it short ----------------

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        b = self._bucket_of[i]
        communicates = self.communicates and b >= 0  # sparse: reduced in _finalize
        solo = self._solo_now(b)
        used, order, clock = self._used, self.order, time.time_ns

        def hook(p: torch.Tensor) -> None:
            if not self._active:
                self._begin()
            used[i] = True
            if not self._syncing:
                return
            counts = self.counts
            if counts is not None and not counts.arrive(i):
                return  # static graph: more arrivals to come (or still learning how many)
            if self.find_unused_parameters and counts is None:
                self._same_task(i)
            seen = self._seen
            if seen[i]:
                self._fired_twice(i)
            seen[i] = True
            order.append(i)
            self.times["compute_end"] = clock()
            if b < 0:
                return
            if communicates:
                self._place(i, b, p, solo)
            pending = self._pending
            pending[b] -= 1
            if pending[b] == 0 and b == self._next:
                self._launch_ready()

        return hook

    def _solo_now(self, b: int) -> bool:
        # A parameter alone in its bucket, with plain all-reduce: its gradient is reduced where
        # autograd left it, with no copy (the flat slot is only used when .grad is the slot).
        return b >= 0 and self.communicates and self._solo[b] and self._comm_hook is None

    def _same_task(self, i: int) -> None:
        """find_unused_parameters without static_graph: refuse gradients from a nested
        (reentrant) backward, as torch does (passes.py says why)."""
        task = passes.current_task()
        if self._task is None:
            self._task = task
        elif task != self._task:
            self._reset()
            raise passes.reentrant_unused_error(self.names[i], self.rank)

    def _place(self, i: int, b: int, p: torch.Tensor, solo: bool) -> None:
        """Leave ``p``'s gradient, divided by the world size, where bucket ``b`` reduces it."""
        g, scale, view = p.grad, self._scale, self._views[i]
        if view is not None and g is view:  # zero_grad(set_to_none=False) kept our view
            if scale != 1.0:
                view.mul_(scale)
        elif solo and reducible_in_place(g, self.buckets[b]):
            if scale != 1.0:
                g.mul_(scale)
            self._in_place[b] = g.view(-1)
        else:  # copy and average in one pass, then let .grad alias the bucket
            view = self._slot(i)
            try:
                torch.mul(g, scale, out=view)
                # autograd's fresh gradient is freed here (torch's gradient_as_bucket_view): a
                # CPU rank kept it until the next step to spare page faults, and held a second
                # copy of every gradient (+23 MiB proportional set on the GPT-2 recipe).
            except RuntimeError:
                if not g.requires_grad:
                    raise
                copy_higher_order(g, scale, view)
            p.grad = view

    def _begin(self) -> None:
        self._active = True
        self.started = True
        self._syncing = bool(self.should_sync())
        self.order.clear()
        self.times = {"compute_end": time.time_ns()}
        Variable._execution_engine.queue_callback(self._on_pass_end)

    def _on_pass_end(self) -> None:
        """End of an autograd graph task: finalize, unless it is a nested one (reentrant
        checkpointing) and gradients are still to come from the enclosing backward."""
        if self._active and self._syncing and self._hidden_from_forward():
            name = self.names[self.order[0]] if self.order else self.names[0]
            self._reset()
            raise passes.reentrant_unused_error(name, self.rank)
        pending = self._active and self._syncing and not self._complete()
        if pending and passes.finish_in_outer(self._on_pass_end):
            return
        self._finalize()

    def _hidden_from_forward(self) -> bool:
        """find_unused_parameters without static_graph, and this pass's gradients came from a
        nested backward that the forward did not run in: torch's search for unused parameters
        could not have seen them, and torch refuses (passes.py)."""
        if not self.find_unused_parameters or self.counts is not None or self.forward_in_backward:
            return False
        return passes.nested()

    def _complete(self) -> bool:
        """Every bucket launched and every sparse gradient in (nothing more can arrive)."""
        if self.counts is not None and self.counts.learning:
            return False
        return self._next == len(self._sizes) and all(self._seen[i] for i in self._sparse)

    def _grad_bucket(self, b: int) -> GradBucket:
        """Bucket ``b`` as torch's communication hooks see it."""
        indices = self.buckets[b].indices
        return GradBucket(
            b,
            self._flat[b],
            [self._views[i] for i in indices],
            [self.params[i] for i in indices],
            last=b == len(self.buckets) - 1,
        )

    def _launch_ready(self) -> None:
        """Start the all-reduce of every complete bucket, in bucket order."""
        pending, n = self._pending, len(self._sizes)
        while self._next < n and pending[self._next] == 0:
            b = self._next
            self._next += 1
            self.times.setdefault("comm_start", time.time_ns())
            timing.bucket_ready()  # the step anatomy's arrival: ready before any wait
            if self.communicates and self._comm_hook is not None:
                state, comm_hook = self._comm_hook
                self._works[b] = check_future(comm_hook(state, self._grad_bucket(b)))
            elif self.communicates:
                wire = self._wire[b]
                tensor = self._in_place[b]
                if tensor is None:
                    flat = self._flat_of(b)
                    tensor = flat if wire is None else comp.compress(flat, wire)
                # Fingerprinted: a rank that diverges or stops is explained, not just timed out.
                entry = fingerprints.record(
                    "all_reduce",
                    tensor,
                    label=f"gradient bucket {b}",
                    group=self.group,
                    extra="sum",
                )
                self._works[b] = entry
                shared = self.shares(b)
                if shared is not None:
                    self._fence = True
                    entry.watch(shared.all_reduce(b))
                else:
                    entry.watch(dist.all_reduce(tensor, group=self.group, async_op=True))
        if self._fence is True and self._next == n:  # the pass's last shared bucket is out
            self._fence = self.shared.fence()  # type: ignore[union-attr]

    def _held(self, b: int) -> bool:
        """Bucket ``b``'s buffer is this rank's slot of the shared-memory file."""
        return self.shared is not None and self.shared.holds(b)

    def shares(self, b: int) -> SharedBuckets | None:
        """Where bucket ``b`` is reduced through shared memory: there, else None (Gloo or a
        communication hook)."""
        if not self._held(b) or self._comm_hook is not None or self._wire[b] is not None:
            return None
        return self.shared

    # -- end of backward ----------------------------------------------------------------------

    def _finalize(self) -> None:
        """Runs once at the end of each backward pass (autograd's final callback)."""
        self._active = False
        if not self._syncing:
            return
        done = False
        try:
            end_of_pass.run(self)
            done = True
        finally:
            if self.counts is not None:
                self.counts.end_pass(done)
            self.last_used = list(self._used)
            self._used[:] = [False] * len(self._used)
            self._reset()
        if self.on_pass_end is not None:
            self.on_pass_end()

    def _reset(self) -> None:
        self._active = False
        self._syncing = False
        self._seen = [False] * len(self.params)
        self._pending = list(self._sizes)
        self._next = 0
        self._task: int | None = None  # the graph task of this pass's first gradient
        self._works: list[Any] = [None] * len(self.buckets)
        self._fence: Any = None  # True once a shared bucket is launched, then its Work
        self._in_place[:] = [None] * len(self.buckets)

    def prepare_for_forward(self) -> None:
        """Forget a backward pass that died half-way (an exception inside autograd)."""
        if self._active:
            if self.counts is not None:
                self.counts.end_pass(False)
            self._reset()

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapper is being rebuilt or discarded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _fired_twice(self, i: int) -> None:
        self._reset()
        if self.counts is not None:
            self.counts.end_pass(False)
        raise passes.twice_error(self.names[i], self.rank)
