"""The end of a synchronised backward pass (``Reducer._finalize``), step by step.

What autograd left undone is completed here: a static graph's first pass places every gradient
at once, locally unused parameters get their slot (zeros or their .grad), the used-parameter
map is agreed, sparse gradients are reduced, and every reduction is waited for. Functions of the
reducer's state, kept apart so that reducer.py reads as the hot path it mostly is.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ....diagnose import fingerprints
from ....timing import clock as timing
from .. import compression as comp
from ..comm_hooks import check_future, take_result
from . import passes
from . import sparse as sp
from .grad_views import copy_higher_order

Reducer = Any
"""``reducer.Reducer``, which calls these functions: named, not imported (no import circle)."""


def catch_up(r: Reducer) -> None:
    """First static-graph pass: every gradient that arrived is complete now; place them."""
    for i, n in enumerate(r.counts.count):  # type: ignore[union-attr]
        if n and not r._seen[i]:
            r._seen[i] = True
            r.order.append(i)
            b = r._bucket_of[i]
            if b < 0:
                continue
            if r.communicates:
                r._place(i, b, r.params[i], r._solo_now(b))
            r._pending[b] -= 1
    r._launch_ready()

def launch_sparse(r: Reducer, used: list[int] | None) -> list[tuple[int, Any, torch.Tensor]]:
    """Start each sparse gradient's reduction, in parameter order. Sync point: all ranks."""
    if not r.communicates:
        return []
    works = []
    for k, i in enumerate(r._sparse):
        if used is not None and used[i] == 0:
            continue  # unused on every rank: .grad stays as it is, as for dense ones
        grad, p = sp.local_grad(r.params[i], r._scale), r.params[i]
        label = f"sparse gradient {r.names[i]}"
        if r._comm_hook is not None:
            state, comm_hook = r._comm_hook
            last = k == len(r._sparse) - 1
            bucket = sp.SparseBucket(len(r.buckets) + k, p, grad, last)
            works.append((i, check_future(comm_hook(state, bucket)), grad))
        else:
            works.append((i, sp.all_reduce(grad, r.group, label), grad))
    return works

def take_sparse(r: Reducer, works: list[tuple[int, Any, torch.Tensor]]) -> None:
    for i, work, grad in works:
        if isinstance(work, torch._C.Future):
            r.params[i].grad = sp.hook_result(work.wait())
        else:
            work.wait()
            r.params[i].grad = grad  # Gloo's sparse all-reduce leaves the sum in it

def fill_unused(r: Reducer, missing: list[int]) -> None:  # dense ones only
    """Put what each locally unused parameter has (its .grad or zeros) into its slot."""
    scale = r._scale
    for i in missing if r.communicates else ():
        view, g = r._slot(i), r.params[i].grad
        if g is None:
            view.zero_()
        elif g is view:
            view.mul_(scale)
        else:
            copy_higher_order(g, scale, view)
    for b in {r._bucket_of[i] for i in missing}:
        r._pending[b] = 0
    r._launch_ready()

def global_use(r: Reducer) -> list[int] | None:
    """How many ranks gave each parameter a gradient. Sync point: all ranks."""
    if not r.communicates:
        return None
    device = r.buckets[0].device
    used = torch.tensor(r._used, dtype=torch.int32, device=device)
    with fingerprints.collective(
        "all_reduce", used, label="used-parameter map", group=r.group, extra="sum"
    ):
        dist.all_reduce(used, group=r.group)
    return used.tolist()

def wait_all(r: Reducer) -> None:
    for b, entry in enumerate(r._works):
        if entry is None:
            continue
        if isinstance(entry, torch._C.Future):  # a comm hook's (then() gives a _C.Future)
            take_result(entry.wait(), r._flat_of(b), b)
            continue
        entry.wait()  # a failure raises the diagnosis: every rank's last collective
        wire = r._wire[b]
        if wire is not None:
            comp.decompress(wire, r._flat_of(b))
    if r._fence is not None:
        r._fence.wait()  # every rank's sums are in this rank's slot: it may be written again


def run(r: Reducer) -> None:
    """The end of a synchronised pass: catch up (static graph's first pass), fill what got no
    gradient (or refuse it), agree on what was used, average sparse gradients, wait for every
    bucket. Sync point: all ranks of the reducer's group."""
    if r.counts is not None and r.counts.learning:
        catch_up(r)
    lenient = r.find_unused_parameters or r.counts is not None
    missing: list[int] = []
    if not r._complete() or r.counts is not None:
        missing = [i for i, seen in enumerate(r._seen) if not seen]
        if missing and not lenient:
            raise passes.unused_error(r.names, missing, len(r.params), r.rank)
        fill_unused(r, [i for i in missing if not r._is_sparse[i]])
    # Used anywhere since the last sync, on any rank: a gradient from a no_sync()
    # micro-batch counts too, or that replica alone would step with it.
    # From here this rank only waits: for its own buckets' traffic and for slower peers.
    with timing.span("blocked", any_thread=True):
        used = global_use(r) if lenient else None
        sparse_works = launch_sparse(r, used)
        wait_all(r)
        take_sparse(r, sparse_works)
    r.times["comm_end"] = time.time_ns()
    for i in missing:
        # Torch's rule: a parameter unused on every rank keeps its .grad untouched.
        if used is not None and used[i] > 0 and not r._is_sparse[i]:
            r.params[i].grad = r._views[i]
