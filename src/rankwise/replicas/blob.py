"""One rank's training state as one flat byte buffer, and back: tensors and JSON, no pickle.

The layout is safetensors' (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes), so the buffer is also a valid
``.safetensors`` file. The header's ``__metadata__`` holds the state's structure (dicts, lists,
tuples, numbers, strings; each tensor a reference) and the replica's facts (rank, step, world,
host, time). Peers and files are untrusted: ``decode`` parses JSON and raw numbers only,
checks every size and range, and never runs code. Encoding copies each tensor once, straight
into the buffer: that copy is the snapshot, so training may go on while the buffer travels.
"""

from __future__ import annotations

import json
import numbers
import struct
from typing import Any

import torch

from ..errors import ConfigError

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
MAX_HEADER = 64 << 20
"""A header larger than this is refused (a peer's lie would otherwise be allocated)."""


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The JSON skeleton of ``value``: each tensor replaced by ``{"$t": index}``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$t": len(tensors) - 1}
    if isinstance(value, dict):
        return {"$d": [[_key(k), _flatten(v, tensors)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_flatten(v, tensors) for v in value]
    if isinstance(value, tuple):
        return {"$tu": [_flatten(v, tensors) for v in value]}
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise ConfigError(
        f"replicas: the training state holds a {type(value).__name__}, which a replica cannot "
        "carry (tensors, numbers, strings, lists, tuples and dicts only)",
        fix="keep only plain values in state_dict()s (and rt.save's extra=); convert objects "
        "to tensors or numbers.",
    )


def _key(k: Any) -> Any:
    if k is None or isinstance(k, (str, bool, int, float)):
        return k
    return _flatten(k, [])  # numpy integers and the like


def encode(state: Any, info: dict[str, Any]) -> torch.Tensor:
    """``state`` and ``info`` as one uint8 tensor (the safetensors layout, on the CPU)."""
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(state, tensors)
    header: dict[str, Any] = {"__metadata__": {"skeleton": json.dumps(skeleton),
                                               "info": json.dumps(info)}}  # fmt: skip
    offset = 0
    for i, t in enumerate(tensors):
        if t.dtype not in DTYPES:
            raise ConfigError(
                f"replicas: a tensor of dtype {t.dtype} cannot be replicated",
                fix="keep optimizer and model state in a float/int/bool dtype.",
            )
        size = t.numel() * t.element_size()
        header[f"t{i}"] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-aligned
    start = 8 + len(text)
    out = torch.empty(start + offset, dtype=torch.uint8)
    out[:start] = torch.frombuffer(
        bytearray(struct.pack("<Q", len(text)) + text), dtype=torch.uint8
    )
    for i, t in enumerate(tensors):
        a, b = header[f"t{i}"]["data_offsets"]
        if b > a:
            flat = t.detach().reshape(-1).contiguous()
            out[start + a : start + b].copy_(flat.cpu().view(torch.uint8))
    return out


def _bad(what: str) -> ConfigError:
    return ConfigError(f"replicas: a replica is malformed: {what}",
                       fix="delete the replica folder (RANKWISE_REPLICA_DIR) and resume from "
                       "the last disk checkpoint.")  # fmt: skip


def decode(buf: torch.Tensor) -> tuple[Any, dict[str, Any]]:
    """``(state, info)`` from ``encode``'s buffer; refuses anything malformed, runs no code."""
    if not isinstance(buf, torch.Tensor):
        buf = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else torch.empty(0)
    buf = buf.reshape(-1).to(torch.uint8)
    if buf.numel() < 8:
        raise _bad(f"{buf.numel()} bytes")
    (n,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    if n > min(MAX_HEADER, buf.numel() - 8):
        raise _bad(f"a header of {n} bytes in a buffer of {buf.numel()}")
    try:
        header = json.loads(buf[8 : 8 + n].numpy().tobytes())
        meta = header.pop("__metadata__")
        skeleton, info = json.loads(meta["skeleton"]), json.loads(meta["info"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _bad(f"its header does not parse ({exc})") from None
    data = buf[8 + n :]
    tensors = {name: _tensor(entry, data) for name, entry in header.items()}
    if not isinstance(info, dict):
        raise _bad("its facts are not a mapping")
    return _unflatten(skeleton, tensors, 0), info


def _tensor(entry: Any, data: torch.Tensor) -> torch.Tensor:
    try:
        dtype, shape = BY_NAME[entry["dtype"]], [int(d) for d in entry["shape"]]
        a, b = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise _bad(f"a tensor entry {str(entry)[:80]!r}") from None
    numel = 1
    for d in shape:
        numel *= d
    size = numel * torch.empty((), dtype=dtype).element_size()
    if min(shape, default=0) < 0 or not 0 <= a <= b <= data.numel() or b - a != size:
        raise _bad(f"a tensor of shape {shape} over bytes {a}..{b} of {data.numel()}")
    return data[a:b].clone().view(dtype).reshape(shape)  # a copy: aligned, its own storage


def _unflatten(node: Any, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    if depth > 64:
        raise _bad("its structure nests deeper than 64 levels")
    if isinstance(node, list):
        return [_unflatten(v, tensors, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"$t"} and f"t{node['$t']}" in tensors:
        return tensors[f"t{node['$t']}"]
    if set(node) == {"$tu"} and isinstance(node["$tu"], list):
        return tuple(_unflatten(v, tensors, depth + 1) for v in node["$tu"])
    if set(node) == {"$d"} and isinstance(node["$d"], list):
        pairs = node["$d"]
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise _bad("a mapping that is not a list of pairs")
        return {_hashable(_unflatten(k, tensors, depth + 1)): _unflatten(v, tensors, depth + 1)
                for k, v in pairs}  # fmt: skip
    raise _bad(f"an unknown node {str(node)[:80]!r}")


def _hashable(k: Any) -> Any:
    if isinstance(k, (list, dict, torch.Tensor)):
        raise _bad("a mapping key that is not a plain value")
    return k
