"""The bytes of an activation header between pipeline stages (``p2p`` sends them): its fields,
limits and checks. A header comes from another process: it is checked before anything is
allocated for what it announces.

    [micro_batch, num_micro_batches, dtype_code, ndim, size_0, ..., size_{MAX_DIMS-1}]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigError, DistributedError

MAX_DIMS = 8
HEADER_LEN = 4 + MAX_DIMS
HEADER_BYTES = HEADER_LEN * 8
PACK_MAX_BYTES = 1 << 20
"""Largest activation sent in one message with its header over Gloo (a copy of it, into the
message, costs about what a second message costs at this size)."""
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


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def packs(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether an activation of this shape goes in one message with its header (Gloo)."""
    return nbytes(shape, dtype) <= PACK_MAX_BYTES


def pack(header: torch.Tensor, tensor: torch.Tensor | None, size: int) -> torch.Tensor:
    """One message of ``header``'s bytes followed by ``size`` bytes: ``tensor``'s, or zeros
    (a filler for a receive posted for another shape); read back in place after the header
    (8-byte aligned)."""
    out = torch.empty(HEADER_BYTES + size, dtype=torch.uint8, device=header.device)
    out[:HEADER_BYTES].view(torch.int64).copy_(header)
    if tensor is None:
        out[HEADER_BYTES:].zero_()
    else:
        out[HEADER_BYTES:].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return out


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
    size = nbytes(tuple(shape), DTYPES[code])
    if size > MAX_ACTIVATION_BYTES:
        return f"announces {size} bytes (the limit is {MAX_ACTIVATION_BYTES})"
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


@dataclass(frozen=True)
class Expected:
    """What the next activation from a peer must be: ``micro_batch`` of ``count`` (None until
    known), sent by ``sender`` (a stage and its rank, named in errors)."""

    sender: str
    micro_batch: int
    count: int | None = None
