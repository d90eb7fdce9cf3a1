"""One flat unit at run time: its full buffer, this rank's shard, and their collectives.

The model's parameters become views into the unit's flat ``full`` buffer, set once: their
``.data`` never changes afterwards. Stage 3 frees the buffer by shrinking its *storage* to zero
bytes and re-gathers into the same storage, so every view (including the ones autograd saved
during forward, such as a transposed weight) sees the gathered values again before backward.

The optimizer never sees the model's parameters: it updates ``shard``, a 1-D parameter holding
this rank's slice of the unit. Under stages 1 and 2 ``shard`` is a view into ``full`` (updated
in place, then the other slices are all-gathered into the same buffer); under stage 3 it is the
only copy that persists.

Gradients: each parameter's gradient, divided by N, is copied into its slot of a flat gradient
buffer laid out like ``full``; one collective per unit then sums it across ranks (stage 1:
all-reduce, every rank keeps the whole averaged gradient; stages 2 and 3: reduce-scatter, each
rank keeps only its slice and the full buffer is dropped). Stage 1's buffer is a slot of
shared memory where every rank is on one machine (``comm/shared.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...diagnose import fingerprints
from ...timing import clock as timing
from .comm import shard_comm
from .layout import UnitLayout


class FlatUnit:
    """Parameters of one unit stored flat and sharded over the group (see the module text)."""

    def __init__(
        self,
        spec: UnitLayout,
        params: list[nn.Parameter],
        *,
        number: int,
        stage: int,
        rank: int,
        group: dist.ProcessGroup | None,
        gather_group: dist.ProcessGroup | None,
        device: torch.device | None = None,
        broadcast: bool = False,
    ) -> None:
        self.spec, self.params, self.number, self.stage = spec, params, number, stage
        self.group, self.gather_group = group, gather_group
        self.communicates = spec.world_size > 1
        first = params[0]
        self.dtype = first.dtype
        self.device = device if first.is_meta and device is not None else first.device
        self.lo, self.hi = spec.shard_range(rank)
        self._gather_entry: fingerprints.Entry | None = None
        self.grad_full: torch.Tensor | None = None
        self._reduce_entry: fingerprints.Entry | None = None
        self._reduce_out: torch.Tensor | None = None
        self.lane = self.gather_lane = None  # hier_comm lanes when the job spans nodes (build)
        self.shared: tuple[Any, int] | None = None  # stage 1's shared-memory slot (comm/shared)
        self.node: Any = None  # stage 3 on one machine: comm/node_shared (``share``)
        self.position = 0  # this unit's place in the reduction order (node_shared's slots)
        self.unfilled = set(range(len(params)))
        """Parameters still on the meta device (``fill`` gives them their values)."""
        if first.is_meta:
            self._start_empty()
        else:
            self._pack(broadcast)

    def _pack(self, broadcast: bool) -> None:
        """An eagerly built unit: its parameters laid end to end (each one's old storage freed
        as it moves), rank 0's values broadcast, this rank's shard kept."""
        full = torch.zeros(self.spec.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for k, p in enumerate(self.params):
                off, n = self.spec.offsets[k], self.spec.numels[k]
                full[off : off + n].copy_(p.detach().reshape(-1))
                p.data = full[off : off + n].view(p.shape)
        self.unfilled.clear()
        if broadcast and self.communicates:  # one unit at a time: no second copy of the model
            entry = fingerprints.record("broadcast", full, label=f"rank 0's unit {self.number}",
                                        group=self.group, extra="src=0")  # fmt: skip
            entry.watch(dist.broadcast(full, group=self.group, group_src=0, async_op=True))
            entry.wait()
        self.full = full
        self._nbytes = full.untyped_storage().nbytes()
        self.gathered = True
        if self.stage < 3:
            self.shard = nn.Parameter(full[self.lo : self.hi])
        else:  # freed at once: building unit by unit, the model never exists twice
            self.shard = nn.Parameter(full[self.lo : self.hi].clone())
            full.untyped_storage().resize_(0)
            self.gathered = False

    def _start_empty(self) -> None:
        """A unit of a meta-built model: zeros waiting for ``fill`` (stage 3: only the shard;
        the full buffer has no memory until gathered)."""
        like = {"dtype": self.dtype, "device": self.device}
        if self.stage < 3:
            self.full = torch.zeros(self.spec.padded, **like)
            self.shard = nn.Parameter(self.full[self.lo : self.hi])
        else:
            self.shard = nn.Parameter(torch.zeros(self.spec.shard_numel, **like))
            self.full = torch.empty(self.spec.padded, **like)  # never written: not resident
        spec = self.spec
        # Views made while the storage has its size (a view of an empty storage is refused).
        self._views = [self.full[off : off + n].view(p.shape)
                       for p, off, n in zip(self.params, spec.offsets, spec.numels, strict=True)]  # fmt: skip
        if self.stage == 3:
            self.full.untyped_storage().resize_(0)
        self._nbytes = self.spec.padded * self.full.element_size()
        self.gathered = self.stage < 3

    def fill(self, k: int, value: torch.Tensor) -> None:
        """Parameter ``k`` has its initial value (``value``, the parameter itself, on any
        device): keep this rank's part of it and make the parameter a view of ``full``."""
        off, n = self.spec.offsets[k], self.spec.numels[k]
        flat = value.detach().reshape(-1)
        with torch.no_grad():
            if self.stage < 3:
                self.full[off : off + n].copy_(flat)
            else:
                a, b = max(off, self.lo), min(off + n, self.hi)
                if a < b:
                    self.shard[a - self.lo : b - self.lo].copy_(flat[a - off : b - off])
        self.params[k].data = self._views[k]
        self.unfilled.discard(k)
        if not self.unfilled:
            del self._views

    def share(self, full: torch.Tensor) -> None:
        """Stage 3 on one machine (``comm/node_shared``): ``full`` is this unit's buffer in
        memory every rank maps. This rank's shard moves into its chunk of it and becomes a view
        of it; the parameters view it for good (never freed, never gathered)."""
        with torch.no_grad():
            full[self.lo : self.hi].copy_(self.shard.detach())
        self.full, self.shard = full, nn.Parameter(full[self.lo : self.hi])
        self.view_params(full)
        self.gathered = True

    def view_params(self, full: torch.Tensor) -> None:
        """Point the unit's parameters at ``full`` (a flat buffer laid out as the unit)."""
        spec = self.spec
        for p, off, n in zip(self.params, spec.offsets, spec.numels, strict=True):
            p.data = full[off : off + n].view(p.shape)

    @property
    def gathered_copy(self) -> bool:
        """The full parameters are here as a copy of every rank's shard (not so for a unit
        whose full buffer is the shards themselves, ``share``)."""
        return self.gathered and self.node is None

    # -- parameters (stage 3 frees and re-gathers them) ---------------------------------------

    def free(self) -> None:
        """Release the full parameters' memory; the views stay, pointing at empty storage."""
        if self.gathered and self.stage == 3 and self.node is None:
            self.wait_gathered()
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def gather(self) -> None:
        """Start the all-gather of the full parameters (no-op when gathered or under way)."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self._nbytes)
        self.gathered = True
        if not self.communicates:
            self.full[self.lo : self.hi].copy_(self.shard.detach())
            return
        entry = fingerprints.record(
            "all_gather", self.shard, label=f"parameters of unit {self.number}",
            group=self.gather_group,
        )  # fmt: skip
        work = shard_comm.all_gather(self.full, self.shard.detach(), self.gather_group,
                                     self.gather_lane)  # fmt: skip
        self._gather_entry = entry
        entry.watch(work)

    def wait_gathered(self) -> None:
        if self._gather_entry is not None:
            with timing.span("blocked", any_thread=True):
                self._gather_entry.wait()
            self._gather_entry = None

    def all_gather_updated(self) -> fingerprints.Entry | None:
        """Stages 1/2 after the step: every rank's updated slice into ``full``, in place."""
        if not self.communicates:
            return None
        entry = fingerprints.record(
            "all_gather", self.shard, label=f"updated parameters of unit {self.number}",
            group=self.group,
        )  # fmt: skip
        mine = self.full[self.lo : self.hi]
        entry.watch(shard_comm.all_gather(self.full, mine, self.group, self.lane))
        return entry

    # -- gradients ----------------------------------------------------------------------------

    def grad_slot(self, k: int) -> torch.Tensor:
        """The slot of the ``k``-th parameter in the flat gradient buffer (allocated on use)."""
        if self.grad_full is None:
            if self.shared is not None:  # stage 1 keeps it: made once, zeros at first
                self.grad_full = self.shared[0].flat(self.shared[1])
            elif self.node is not None:  # stage 3 on one machine: a rotating shared slot
                self.grad_full = self.node.grads.buffer(self)
            else:
                self.grad_full = torch.zeros(self.spec.padded, dtype=self.dtype,
                                             device=self.device)  # fmt: skip
        off, n = self.spec.offsets[k], self.spec.numels[k]
        return self.grad_full[off : off + n].view(self.params[k].shape)

    def launch_reduce(self) -> None:
        """Sum the (already divided by N) gradient buffer across ranks, asynchronously."""
        if self.grad_full is None:  # no parameter of the unit had anything to contribute
            self.grad_slot(0)
        if not self.communicates:
            self._reduce_out = self.grad_full[self.lo : self.hi]
            return
        timing.bucket_ready()  # the step anatomy's arrival: ready before any wait
        if self.stage == 1:
            op, out = "all_reduce", None
            if self.shared is not None:
                shared, b = self.shared
                work = lambda: shared.all_reduce(b)  # noqa: E731
            else:
                work = lambda: shard_comm.all_reduce(self.grad_full, self.group, self.lane)  # noqa: E731
        elif self.node is not None:  # the sum lands in this rank's chunk of its shared slot
            op, out = "reduce_scatter", None
            work = lambda: self.node.grads.reduce_scatter(self)  # noqa: E731
        else:
            op = "reduce_scatter"
            if shard_comm.in_place(self.group) or self.lane:  # the sum lands in its own chunk
                out = self.grad_full[self.lo : self.hi]
            else:
                out = torch.empty(self.spec.shard_numel, dtype=self.dtype, device=self.device)
            work = lambda: shard_comm.reduce_scatter(self.grad_full, out, self.group, self.lane)  # noqa: E731
        entry = fingerprints.record(
            op, self.grad_full, label=f"gradients of unit {self.number}", group=self.group,
            extra="sum",
        )  # fmt: skip
        entry.watch(work())
        self._reduce_entry, self._reduce_out = entry, out

    def finish_reduce(self) -> None:
        """Wait for the reduction; leave the averaged slice in ``shard.grad`` (accumulating)."""
        if self._reduce_entry is not None:
            with timing.span("blocked", any_thread=True):
                self._reduce_entry.wait()
            self._reduce_entry = None
        if self.stage == 1:
            # The whole averaged gradient stays (stage 1 shards only optimizer state); the
            # optimizer reads this rank's slice of it, without a copy.
            self.shard.grad = self.grad_full[self.lo : self.hi]
            self._reduce_out = None
            return
        out = self._reduce_out
        if out is None and self.grad_full is not None:
            out = self.grad_full[self.lo : self.hi]
        self._reduce_out, self.grad_full = None, None
        if out is None:
            return
        if self.shard.grad is None:
            self.shard.grad = out.clone() if out._base is not None else out
        else:
            self.shard.grad.add_(out)
