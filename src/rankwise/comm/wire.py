"""Collectives of bytes and JSON for rankwise's own messages: nothing a peer sends is unpickled.

``torch.distributed``'s ``*_object`` collectives unpickle what every other rank sends, so any
peer (a compromised node, an outsider joining an elastic rendezvous) can run code in every rank.
rankwise's internal messages (model signatures, the save status, agreement tokens, metric
descriptions, RNG states) go through these functions instead: UTF-8 JSON or ``torch.save``
bytes read back with ``weights_only=True``, in uint8 tensors. A message that does not decode is
a ``DistributedError`` naming the rank that sent it, on every rank that received it.

The framing is the one torch's object collectives use (the sizes first, then the padded bytes),
so a peer that still sends a pickle lines up, is read as bytes, and is refused.
``rw.all_gather_object`` / ``rw.broadcast_object`` (for user code) still pickle: they trust
every rank, as documented in docs/pitfalls.md.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch
import torch.distributed as dist

from ..diagnose import fingerprints
from ..errors import DistributedError

MAX_BYTES = 256 * 1024 * 1024
"""Largest message accepted from a peer: a larger announced size is refused before allocating."""
MAX_DEPTH = 64
"""Deepest nesting of lists and objects accepted in a JSON message (rankwise's own nest a few
levels; Python's decoder would raise RecursionError on every rank near a thousand)."""


def _device(group: Any) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group: Any, r: int) -> int:
    return r if group is None else dist.get_process_group_ranks(group)[r]


def _refuse(group: Any, r: int, label: str, why: str, data: bytes = b"") -> DistributedError:
    start = f" (starts {data[:16]!r})" if data else ""
    return DistributedError(
        f"rank {global_rank(group, r)} sent a {label} message that {why}{start}; rankwise never "
        "unpickles or runs what other ranks send, so the job stops here",
        fix="every rank must run the same rankwise version; a rank that sends anything else is "
        "not part of this job (check who can reach the rendezvous address and port).",
        rank=dist.get_rank(),
    )


def _sizes_ok(sizes: list[int], group: Any, label: str, max_bytes: int) -> None:
    for r, n in enumerate(sizes):
        if not 0 <= n <= max_bytes:
            raise _refuse(group, r, label, f"announces {n} bytes (the limit is {max_bytes})")


def _to_bytes(t: torch.Tensor, n: int) -> bytes:
    return t[:n].cpu().numpy().tobytes()


def all_gather_bytes(
    data: bytes, *, label: str, group: Any = None, max_bytes: int = MAX_BYTES
) -> list[bytes]:
    """Every rank's ``data``, in group rank order. Sync point: the ranks of ``group``.

    One fingerprinted collective (the sizes, then the padded bytes), as torch's own
    ``all_gather_object`` is one call.
    """
    device = _device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    with fingerprints.collective("all_gather", size, label=label, group=group):
        sizes = [torch.empty_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        counts = [int(s.item()) for s in sizes]
        _sizes_ok(counts, group, label, max_bytes)
        mine = _padded(data, max(max(counts), 1), device)
        slots = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(slots, mine, group=group)
    return [_to_bytes(s, n) for s, n in zip(slots, counts, strict=True)]


def _padded(data: bytes, n: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def broadcast_bytes(
    data: bytes | None, src: int = 0, *, label: str, group: Any = None, max_bytes: int = MAX_BYTES
) -> bytes:
    """Rank ``src``'s ``data`` (a group rank; others pass None) on every rank.

    Sync point: the ranks of ``group`` (one fingerprinted collective: the size, the bytes).
    """
    device = _device(group)
    root = dist.get_rank(group) == src
    size = torch.tensor([len(data) if root and data else 0], dtype=torch.int64, device=device)
    with fingerprints.collective("broadcast", size, label=label, group=group, extra=f"src={src}"):
        dist.broadcast(size, group=group, group_src=src)
        n = int(size.item())
        if not 0 <= n <= max_bytes:
            raise _refuse(group, src, label, f"announces {n} bytes (the limit is {max_bytes})")
        buf = _padded(data if root and data else b"", max(n, 1), device)
        dist.broadcast(buf, group=group, group_src=src)
    return _to_bytes(buf, n)


def encode_json(value: Any) -> bytes:
    """``value`` as UTF-8 JSON (the wire format of every JSON message)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (0 for a number or string), iteratively."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth + 1)
            if depth + 1 > MAX_DEPTH:
                break
            stack.extend(
                (x, depth + 1) for x in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def _decode_json(data: bytes, group: Any, r: int, label: str) -> Any:
    try:
        value = json.loads(data.decode("utf-8"))
        deep = _depth(value) > MAX_DEPTH
    except (UnicodeDecodeError, ValueError):
        raise _refuse(group, r, label, "is not UTF-8 JSON", data) from None
    except RecursionError:  # json's decoder recurses per level: a peer can exhaust the stack
        deep = True
    if deep:
        why = f"nests lists or objects more than {MAX_DEPTH} levels deep"
        raise _refuse(group, r, label, why, data) from None
    return value


def all_gather_json(value: Any, *, label: str, group: Any = None) -> list[Any]:
    """Every rank's JSON-serialisable ``value`` (tuples come back as lists), in group rank
    order. Sync point: the ranks of ``group``."""
    raw = all_gather_bytes(encode_json(value), label=label, group=group)
    return [_decode_json(data, group, r, label) for r, data in enumerate(raw)]


def broadcast_json(value: Any, src: int = 0, *, label: str, group: Any = None) -> Any:
    """Rank ``src``'s JSON-serialisable ``value`` on every rank. Sync point: the ranks of
    ``group``."""
    root = dist.get_rank(group) == src
    data = broadcast_bytes(encode_json(value) if root else None, src, label=label, group=group)
    return _decode_json(data, group, src, label)


def encode_tensors(value: Any) -> bytes:
    """``value`` (tensors, numbers, strings, lists, dicts) as ``torch.save`` bytes."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def all_gather_tensors_state(value: Any, *, label: str, group: Any = None) -> list[Any]:
    """Every rank's ``value`` of tensors and plain data (e.g. RNG states), read back with
    ``torch.load(weights_only=True)``: no code runs. Sync point: the ranks of ``group``."""
    raw = all_gather_bytes(encode_tensors(value), label=label, group=group)
    out = []
    for r, data in enumerate(raw):
        try:
            out.append(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
        except Exception as exc:  # any refusal of the safe loader is the peer's doing
            why = f"torch's weights_only loader refuses ({type(exc).__name__})"
            raise _refuse(group, r, label, why, data) from None
    return out
