"""Uneven inputs: ``with model.join(): ...`` (torch's ``Join`` protocol).

A rank that runs out of batches leaves its training loop and waits in ``Join.__exit__``; for as
long as other ranks still train, it *shadows* their collectives so that nobody hangs:

===========================  ==============================  ==============================
a training rank's forward    a training rank's backward      a joined rank (``main_hook``)
===========================  ==============================  ==============================
notify: all-reduce of 1       (torch's Join counts ranks)     Join's own all-reduce of 0
sync flag: all-reduce                                        all-reduce of 0 (read the flag)
buffers: broadcast from 0                                    the same broadcast
                              one all-reduce per bucket       zeros, per bucket, same order
                              used-parameter map              a map of zeros
===========================  ==============================  ==============================

A joined rank contributes zero gradients; the others still divide by the full world size
(``divide_by_initial_world_size=True``, torch's default). When every rank has joined, the last
one to join broadcasts its parameters and buffers, so all replicas end identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from ...diagnose import fingerprints
from ..agreement import broadcast_tensors
from . import compression as comp

if TYPE_CHECKING:
    from torch import nn

    from .reduction.reducer import Reducer


class JoiningDDP(Protocol):
    """What a joined rank reads of ``DistributedDataParallel`` (which imports this module)."""

    module: nn.Module
    process_group: Any
    rank: int
    join_device: torch.device
    reducer: Reducer
    compression: Any
    broadcast_buffers: bool
    find_unused_parameters: bool
    require_backward_grad_sync: bool
    _buffer_slots: Any

    def _sync_buffers(self) -> None: ...


def sync_flag(ddp: JoiningDDP, joined: bool) -> torch.Tensor:
    """All-reduce whether any training rank synchronises this step. Sync point: all ranks."""
    flag = torch.zeros(1, device=ddp.join_device)
    if not joined and ddp.require_backward_grad_sync:
        flag += 1
    with fingerprints.collective("all_reduce", flag, label="join: sync flag", group=ddp.process_group):
        dist.all_reduce(flag, group=ddp.process_group)
    return flag


class DDPJoinHook(JoinHook):
    """What a joined rank does in place of one training step, and once everyone has joined."""

    def __init__(self, ddp: JoiningDDP) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        if sync_flag(ddp, joined=True).item() == 0:
            return  # the training ranks are inside no_sync(): no collective to shadow
        if ddp.broadcast_buffers and ddp._buffer_slots:
            ddp._sync_buffers()  # matches the training ranks' forward broadcast
        _shadow_buckets(ddp)
        reducer = ddp.reducer
        if ddp.find_unused_parameters:
            device = reducer.buckets[0].device
            used = torch.zeros(len(reducer.params), dtype=torch.int32, device=device)
            with fingerprints.collective(
                "all_reduce", used, label="used-parameter map", group=ddp.process_group, extra="sum"
            ):
                dist.all_reduce(used, group=ddp.process_group)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every replica takes the last joiner's parameters and buffers. Sync point: all ranks."""
        ddp = self.ddp
        mine = torch.tensor([ddp.rank if is_last_joiner else -1], device=ddp.join_device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=ddp.process_group)
        module = ddp.module
        state = [p.detach() for p in module.parameters()] + [b.detach() for b in module.buffers()]
        broadcast_tensors(state, ddp.process_group, src=int(mine.item()))


def _shadow_buckets(ddp: JoiningDDP) -> None:
    """All-reduce zeros in place of each bucket, in order, by the bucket's own transport.

    All are started before any is waited for, as the training ranks' reducer does: a shared
    bucket completes only when the next one (or the fence) starts.
    """
    reducer, group = ddp.reducer, ddp.process_group
    wire = comp.wire_dtype(ddp.compression)
    entries, shared_used = [], None
    for b, bucket in enumerate(reducer.buckets):
        shared = reducer.shares(b)
        if shared is not None:
            zeros = shared.flat(b)  # the slot other ranks read (this rank's .grad: unused now)
            zeros.zero_()
        else:
            dtype = wire if comp.compresses(bucket.dtype, wire) else bucket.dtype
            zeros = torch.zeros(bucket.numel, dtype=dtype, device=bucket.device)
        label = f"gradient bucket {b}"
        entry = fingerprints.record("all_reduce", zeros, label=label, group=group, extra="sum")
        if shared is not None:
            shared_used = shared
            entry.watch(shared.all_reduce(b))
        else:
            entry.watch(dist.all_reduce(zeros, group=group, async_op=True))
        entries.append(entry)
    last = shared_used.fence() if shared_used is not None else None
    for entry in entries:
        entry.wait()
    if last is not None:
        last.wait()


def join_context(ddp: JoiningDDP, **kwargs: Any) -> Join:
    """``Join([ddp], ...)``: the context manager ``DistributedDataParallel.join`` returns."""
    return Join([ddp], **kwargs)
