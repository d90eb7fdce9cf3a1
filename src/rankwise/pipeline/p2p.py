"""The wire protocol between pipeline stages in different processes: a header, then the tensor.

Forward activations may change shape from batch to batch (the last batch of an epoch, a
micro-batch that is one sample shorter), so each one is preceded by a fixed-size int64 header
that the receiver can always post a receive for:

    [micro_batch, num_micro_batches, dtype_code, ndim, size_0, ..., size_{MAX_DIMS-1}]

Backward gradients need no header: the gradient of an activation has its shape and dtype,
which the receiver already knows from the forward. Every receive waits at most the runtime's
timeout and then raises a ``DistributedError`` naming the peer, the phase and the micro-batch.
A header is checked before anything is allocated for it (its number, the micro-batch count,
dtype, dimensions and a size cap): a wrong one is a ``DistributedError`` naming the stage that
sent it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError, DistributedError

MAX_DIMS = 8
HEADER_LEN = 4 + MAX_DIMS
MAX_MICRO_BATCHES = 1 << 16
"""Most micro-batches a header may announce (``chunks`` of any real pipeline is far lower)."""
MAX_ACTIVATION_BYTES = 64 << 30
"""Largest activation a header may announce: a receiver allocates it before it arrives."""
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)


@dataclass(frozen=True)
class Header:
    micro_batch: int
    num_micro_batches: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def encode(header: Header, device: torch.device) -> torch.Tensor:
    if header.dtype not in DTYPES or len(header.shape) > MAX_DIMS:
        raise ConfigError(
            f"a pipeline stage output has dtype {header.dtype} and shape {list(header.shape)}; "
            f"stages in different processes can pass tensors of dtypes {list(DTYPES)} with at "
            f"most {MAX_DIMS} dimensions",
            fix="reshape or cast the activation at the stage boundary (e.g. flatten it).",
        )
    shape = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    values = [header.micro_batch, header.num_micro_batches, DTYPES.index(header.dtype)]
    return torch.tensor([*values, len(header.shape), *shape], dtype=torch.int64, device=device)


def header_problem(v: list[int], micro_batch: int, count: int | None) -> str:
    """Why a received header cannot be the one expected ('' if it can): it comes from another
    process, and the receiver allocates what it announces."""
    mb, n, code, ndim, sizes = v[0], v[1], v[2], v[3], v[4:]
    if mb != micro_batch:
        return f"is numbered {mb}, not {micro_batch}"
    if not 1 <= n <= MAX_MICRO_BATCHES or (count is not None and n != count):
        expected = count if count is not None else f"1..{MAX_MICRO_BATCHES}"
        return f"announces {n} micro-batches (expected {expected})"
    if not 0 <= code < len(DTYPES):
        return f"has dtype code {code} (not one of 0..{len(DTYPES) - 1})"
    if not 0 <= ndim <= MAX_DIMS:
        return f"has {ndim} dimensions (at most {MAX_DIMS})"
    shape = sizes[:ndim]
    if any(s < 0 for s in shape) or any(sizes[ndim:]):
        return f"has shape {sizes} for {ndim} dimensions"
    nbytes = math.prod(shape) * DTYPES[code].itemsize
    if nbytes > MAX_ACTIVATION_BYTES:
        return f"announces {nbytes} bytes (the limit is {MAX_ACTIVATION_BYTES})"
    return ""


def decode(
    t: torch.Tensor, *, sender: str, micro_batch: int, count: int | None, rank: int
) -> Header:
    """The header of activation ``micro_batch`` (of ``count``, once known) from ``sender``;
    a ``DistributedError`` naming the sender if it is not one this stage can accept."""
    v = t.tolist()
    why = header_problem(v, micro_batch, count)
    if why:
        raise DistributedError(
            f"pipeline {sender} sent an activation header for micro-batch {micro_batch} that "
            f"{why} (header {v}); nothing was allocated or received after it",
            fix="every stage must run the same rankwise version and the same train_step calls; "
            "a process that sends anything else is not part of this pipeline.",
            rank=rank,
        )
    return Header(v[0], v[1], DTYPES[v[2]], tuple(v[4 : 4 + v[3]]))


class Link:
    """Point-to-point traffic of one stage with its neighbours, with timeouts on every receive.

    Sends are asynchronous (``isend``) so a stage computes its next micro-batch while the last
    one is on the wire; ``flush()`` waits for them at the end of each phase.
    """

    def __init__(self, comm_device: torch.device, timeout: timedelta, rank: int) -> None:
        self.comm_device = comm_device
        self.timeout = timeout
        self.rank = rank
        self._pending: list[tuple[dist.Work, torch.Tensor, str]] = []

    def send(self, tensor: torch.Tensor, dst: int, what: str, header: Header | None) -> None:
        """Queue ``tensor`` (preceded by ``header`` if given) for rank ``dst``."""
        parts = [] if header is None else [encode(header, self.comm_device)]
        parts.append(tensor.detach().to(self.comm_device).contiguous())
        for part in parts:
            self._pending.append((dist.isend(part, dst=dst), part, f"{what} to rank {dst}"))

    def recv_header(
        self, src: int, what: str, sender: str, expect: tuple[int, int | None]
    ) -> Header:
        """The header of activation ``expect[0]`` (of ``expect[1]``, once known) from ``src``,
        checked (``decode``); ``sender`` names that stage in errors."""
        buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.comm_device)
        self._wait(dist.irecv(buf, src=src), f"{what} header from rank {src}")
        return decode(buf, sender=sender, micro_batch=expect[0], count=expect[1], rank=self.rank)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.comm_device)
        self._wait(dist.irecv(buf, src=src), f"{what} from rank {src}")
        return buf

    def flush(self) -> None:
        """Wait for every queued send. Sync point: the receiving neighbours."""
        pending, self._pending = self._pending, []
        for work, _, what in pending:
            self._wait(work, what)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise self._error(what, f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
        if ok is False:
            raise self._error(what, "timed out")

    def _error(self, what: str, cause: str) -> DistributedError:
        return DistributedError(
            f"pipeline {what} failed after at most {self.timeout.total_seconds():.0f}s ({cause})",
            fix="every rank of the pipeline must call train_step with the same chunks and the "
            "same number of steps; look for a rank that died or skipped a step.",
            rank=self.rank,
        )
