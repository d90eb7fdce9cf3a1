"""The bytes of an activation header between pipeline stages (``p2p`` sends them): its fields,
limits and checks. A header comes from another process: it is checked before anything is
allocated for what it announces.

    [micro_batch, num_micro_batches, dtype_code, ndim, size_0, ..., size_{MAX_DIMS-1}]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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


def _values(header: Header) -> list[int]:
    if header.dtype not in DTYPES or len(header.shape) > MAX_DIMS:
        raise ConfigError(
            f"a pipeline stage output has dtype {header.dtype} and shape {list(header.shape)}; "
            f"stages in different processes can pass tensors of dtypes {list(DTYPES)} with at "
            f"most {MAX_DIMS} dimensions",
            fix="reshape or cast the activation at the stage boundary (e.g. flatten it).",
        )
    shape = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    values = [header.micro_batch, header.num_micro_batches, DTYPES.index(header.dtype)]
    return [*values, len(header.shape), *shape]


def encode(header: Header, device: torch.device) -> torch.Tensor:
    # built in numpy: a message is sent right after a stage's compute, where each torch call
    # costs several times what it costs in a tight loop (torch.tensor of a list: ~18 us hot)
    t = torch.from_numpy(np.array(_values(header), dtype=np.int64))
    return t if device.type == "cpu" else t.to(device)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def packs(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether an activation of this shape goes in one message with its header (Gloo)."""
    return nbytes(shape, dtype) <= PACK_MAX_BYTES


def pack(header: Header, tensor: torch.Tensor | None, size: int) -> torch.Tensor:
    """One message (on the CPU: Gloo) of ``header``'s bytes followed by ``size`` bytes:
    ``tensor``'s, or zeros (a filler for a receive posted for another shape); read back in
    place after the header (8-byte aligned). Written through numpy: one allocation, no torch
    call per field (see ``encode``)."""
    out = torch.empty(HEADER_BYTES + size, dtype=torch.uint8)
    raw = out.numpy()
    raw[:HEADER_BYTES].view(np.int64)[:] = _values(header)
    if tensor is None:
        raw[HEADER_BYTES:] = 0
    else:
        raw[HEADER_BYTES:] = tensor.reshape(-1).view(torch.uint8).numpy()
    return out


def header_values(buf: torch.Tensor) -> list[int]:
    """The fields of a received header: the int64 tensor of one, or the first bytes of a
    packed message (CPU: read through numpy, without a torch call per view)."""
    if buf.device.type != "cpu":
        return buf.tolist()
    raw = buf.numpy()
    return (raw[:HEADER_BYTES].view(np.int64) if raw.dtype == np.uint8 else raw).tolist()


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
    v: list[int], *, sender: str, micro_batch: int, count: int | None, rank: int
) -> Header:
    """The header ``v`` (``header_values``) of activation ``micro_batch`` (of ``count``, once
    known) from ``sender``; a ``DistributedError`` naming the sender if it is not one this
    stage can accept."""
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
