"""Gradient compression for communication: half the bytes on the wire, fp32 everywhere else.

``compression="bf16"`` (or ``"fp16"``) changes only what travels: each rank's gradients are
already divided by the world size in their own precision (fp32) when they are copied into the
bucket, then rounded to the wire type, summed by the backend in that type, and written back
into the fp32 gradients. Dividing before rounding keeps fp16 sums far from their 65504
overflow; the optimizer never sees a half-precision tensor.

bf16 keeps fp32's exponent range (no overflow, ~3 significant digits); fp16 keeps more digits
(~3.3) but a narrow range. Both lose accuracy, so compression is opt-in and off by default.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError

WIRE_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def wire_dtype(compression: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype gradients travel in for ``compression`` (None: their own dtype)."""
    if compression is None or compression == "none":
        return None
    if isinstance(compression, torch.dtype) and compression in WIRE_DTYPES.values():
        return compression
    if isinstance(compression, str) and compression.lower() in WIRE_DTYPES:
        return WIRE_DTYPES[compression.lower()]
    raise ConfigError(
        f"compression={compression!r} is not supported",
        fix="use compression=None (full precision), 'bf16' or 'fp16'.",
    )


def compresses(bucket_dtype: torch.dtype, wire: torch.dtype | None) -> bool:
    """True when a bucket of ``bucket_dtype`` should travel as ``wire`` (only wider floats)."""
    if wire is None or not bucket_dtype.is_floating_point:
        return False
    return torch.finfo(bucket_dtype).bits > torch.finfo(wire).bits


def wire_buffer(flat: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """A reusable buffer of ``flat``'s size in the wire dtype, allocated once per bucket."""
    return torch.empty(flat.numel(), dtype=wire, device=flat.device)


def compress(flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Round the (already averaged) fp32 bucket into its wire buffer; returns the buffer."""
    return out.copy_(flat)


def decompress(out: torch.Tensor, flat: torch.Tensor) -> None:
    """Write the reduced wire buffer back into the fp32 bucket (and so into the gradients)."""
    flat.copy_(out)
