"""The wire protocol between pipeline stages in different processes: a header, then the tensor.

Forward activations may change shape from batch to batch (the last batch of an epoch, a
micro-batch that is one sample shorter), so each one is preceded by a fixed-size int64 header
that the receiver can always post a receive for:

    [micro_batch, num_micro_batches, dtype_code, ndim, size_0, ..., size_{MAX_DIMS-1}]

Backward gradients need no header: the gradient of an activation has its shape and dtype,
which the receiver already knows from the forward. Every receive waits at most the runtime's
timeout and then raises a ``DistributedError`` naming the peer, the phase and the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError, DistributedError

MAX_DIMS = 8
HEADER_LEN = 4 + MAX_DIMS
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


def decode(t: torch.Tensor) -> Header:
    v = t.tolist()
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

    def recv_header(self, src: int, what: str) -> Header:
        buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.comm_device)
        self._wait(dist.irecv(buf, src=src), f"{what} header from rank {src}")
        return decode(buf)

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
