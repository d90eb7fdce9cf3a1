"""Typed collectives for user code: metrics, objects, barriers. No-ops at world size 1.

Each function here is a sync point: every rank of the group must call it, in the same order.
Calling one inside ``if rank == 0:`` hangs the job (until the timeout turns the hang into an
error naming the ranks), which is why rankwise's own helpers (logging, checkpoints) are called
on every rank and decide inside who does the work. Each call is fingerprinted and checked across
ranks before data moves (``rankwise.diagnose``): a mismatch or a hang is explained, with every
rank's operation and call site.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, TypeVar, overload

import torch
import torch.distributed as dist

from .. import runtime, validate
from ..diagnose import fingerprints
from ..errors import DistributedError, RuntimeStateError

Op = Literal["mean", "sum", "max", "min"]
Number = TypeVar("Number", int, float)

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def world_size() -> int:
    """Number of ranks in the default group (1 when not distributed).

    A process that was launched as one of several ranks but never called ``rw.init()`` is an
    error, not world size 1: treating it as alone would make every collective a silent no-op
    and let the replicas drift apart.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    launched = runtime.coords()
    if launched.world_size > 1:
        raise RuntimeStateError(
            f"this process was launched as rank {launched.rank} of {launched.world_size} "
            f"({launched.source}) but rankwise is not initialised, so it cannot "
            "communicate",
            fix="call `rt = rw.init()` at the start of the program, on every rank.",
            rank=launched.rank,
        )
    return 1


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return runtime.coords().rank


def _comm_device() -> torch.device:
    if runtime.is_initialized():
        rt = runtime.get_runtime()
        if rt.backend is None or "nccl" in rt.backend or rt.device.type == "cpu":
            return rt.device
        return torch.device("cpu")
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@overload
def all_reduce(value: torch.Tensor, op: Op = "mean") -> torch.Tensor: ...
@overload
def all_reduce(value: float, op: Op = "mean") -> float: ...
def all_reduce(value, op: Op = "mean"):
    """Reduce a tensor or a Python number over all ranks; returns a new value, input untouched.

    ``mean`` of an integer tensor is returned as float. Sync point: all ranks.
    """
    validate.choice("op", op, _TORCH_OPS, where="rw.all_reduce()")
    _check_number(value)
    is_tensor = isinstance(value, torch.Tensor)
    if world_size() == 1:
        if is_tensor:
            out = value.detach().clone()
            return out.float() if op == "mean" and not out.is_floating_point() else out
        return float(value) if op == "mean" else value
    if is_tensor:
        t = value.detach().to(_comm_device(), copy=True)
    else:
        t = torch.tensor(value, dtype=torch.float64, device=_comm_device())
    if op == "mean" and not t.is_floating_point():
        t = t.double()
    with fingerprints.collective("all_reduce", t, extra=op, check=True):
        dist.all_reduce(t, op=_TORCH_OPS[op])
    if op == "mean":
        t /= world_size()
    if is_tensor:
        return t.to(value.device)
    result = t.item()
    return int(result) if isinstance(value, int) and op != "mean" else result


def _check_number(value: Any) -> None:
    """A tensor, or a number ``float()`` takes (Python's, numpy's); not a string."""
    if isinstance(value, torch.Tensor):
        return
    try:
        ok = not isinstance(value, (str, bytes)) and float(value) is not None
    except (TypeError, ValueError):
        ok = False
    if not ok:
        validate.fail("value", value, "a tensor or a number", where="rw.all_reduce()",
                      fix="pass the number or tensor to reduce, e.g. rw.all_reduce_mean(loss.item()).")


def _check_rank(name: str, value: Any, where: str) -> None:
    """A rank of the job (``src``, ``dst``), so a script that runs alone fails as it would
    launched."""
    validate.integer(name, value, minimum=0, where=where)
    if value >= world_size():
        validate.fail(name, value, f"a rank of the job, 0..{world_size() - 1}", where=where,
                      fix=f"pass {name}=0 (rank 0), or a rank below the world size.")


def all_reduce_mean(value):
    """Mean over all ranks (e.g. of a loss, for logging). Sync point: all ranks."""
    return all_reduce(value, "mean")


def all_reduce_sum(value):
    """Sum over all ranks (e.g. of correct predictions). Sync point: all ranks."""
    return all_reduce(value, "sum")


def all_reduce_max(value):
    """Maximum over all ranks (e.g. of step time). Sync point: all ranks."""
    return all_reduce(value, "max")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank. Sync point: all ranks.

    Pickled: every rank unpickles what ``src`` sends, so it trusts ``src`` to run code in it.
    Fine between the ranks of your own job; rankwise's own messages never use it (``wire``).
    """
    _check_rank("src", src, "rw.broadcast_object()")
    if world_size() == 1:
        return obj
    box = [obj]
    with fingerprints.collective("broadcast_object", extra=f"src={src}", check=True):
        dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank. Sync point: all ranks.

    Pickled: every rank unpickles what every other rank sends, so it trusts them all to run
    code in it. Fine between the ranks of your own job; rankwise's own messages never use it
    (they go through ``rankwise.comm.wire``: JSON and tensors).
    """
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    with fingerprints.collective("all_gather_object", check=True):
        dist.all_gather_object(out, obj)
    return out


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on ``dst``; None elsewhere. Sync point: all ranks.

    Pickled, like ``all_gather_object``: it trusts every rank.
    """
    _check_rank("dst", dst, "rw.gather_object()")
    if world_size() == 1:
        return [obj]
    # gather_object is not supported by every backend; all_gather costs little more for objects.
    everything = all_gather_object(obj)
    return everything if rank() == dst else None


def barrier(timeout: float | timedelta | None = None) -> None:
    """Wait until every rank arrives; after ``timeout`` raise an error naming the missing ranks.

    Sync point: all ranks.
    """
    validate.timeout("timeout", timeout, where="rw.barrier()")
    if world_size() == 1:
        return
    if timeout is None:
        td = (
            runtime.get_runtime().timeout
            if runtime.is_initialized()
            else timedelta(seconds=runtime.DEFAULT_TIMEOUT_S)
        )
    else:
        td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    entry = fingerprints.record("barrier", check=True)
    try:
        if dist.get_backend() == "gloo":
            # monitored_barrier names the ranks that did not arrive.
            dist.monitored_barrier(timeout=td, wait_all_ranks=True)
        else:
            work = dist.barrier(async_op=True)
            if not work.wait(timeout=td):
                raise RuntimeError("barrier did not complete")
        entry.done()
    except RuntimeError as exc:
        if fingerprints.settings().enabled:
            raise fingerprints.failure(entry, exc) from None  # the message quotes the backend error
        raise DistributedError(
            f"barrier timed out after {td.total_seconds():.0f}s: {str(exc).splitlines()[0]}",
            fix="every rank must reach the same barriers; look for a barrier (or a helper that "
            "synchronises, such as save_checkpoint) inside `if rank == 0:` or a rank that died.",
            rank=rank(),
        ) from exc


# ---- collectives on tensors rankwise owns (flat gradients, parameters, gathered outputs) ----
# Not for user code: they skip the copies the helpers above make, and take a group. They go
# through the same fingerprints, so a rank that issues something else is diagnosed, not hung.


def all_reduce_(
    tensor: torch.Tensor,
    op: Op = "sum",
    *,
    group: Any = None,
    label: str | None = None,
    timeout: float | timedelta | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over ``group`` ('mean': the sum divided by its size).

    Sync point: the ranks of ``group``.
    """
    entry = fingerprints.record("all_reduce", tensor, label=label, group=group, extra=op)
    entry.watch(dist.all_reduce(tensor, op=_TORCH_OPS[op], group=group, async_op=True))
    entry.wait(timeout)
    if op == "mean":
        tensor /= dist.get_world_size(group)
    return tensor


def broadcast_(
    tensor: torch.Tensor, src: int = 0, *, group: Any = None, label: str | None = None
) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``src``'s, in place. Sync point: the ranks of ``group``."""
    entry = fingerprints.record("broadcast", tensor, label=label, group=group, extra=f"src={src}")
    entry.watch(dist.broadcast(tensor, src=src, group=group, async_op=True))
    entry.wait()
    return tensor


def all_gather_tensors(
    tensor: torch.Tensor, *, group: Any = None, label: str | None = None
) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype everywhere), in rank order.

    Sync point: the ranks of ``group``.
    """
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    with fingerprints.collective("all_gather", tensor, label=label, group=group):
        dist.all_gather(slots, tensor, group=group)
    return slots


def all_gather_tensors_async(
    tensor: torch.Tensor, *, group: Any = None, label: str | None = None
) -> tuple[list[torch.Tensor], Any]:
    """``all_gather_tensors`` posted, not waited for: ``(slots, work)``; the slots hold every
    rank's ``tensor`` once ``work.wait()`` returns (the step timing's record overlaps the next
    step with it). Sync point: the ranks of ``group``, at the wait."""
    slots = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    with fingerprints.collective("all_gather", tensor, label=label, group=group):
        work = dist.all_gather(slots, tensor, group=group, async_op=True)
    return slots, work
