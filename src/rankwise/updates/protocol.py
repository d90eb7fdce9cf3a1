"""The parameter server's wire format: a fixed tensor schema, no pickle.

Every message is one fixed-size byte frame: an int64 header ``[kind, rank, version, aux]``
(32 bytes) followed by a body whose meaning the kind fixes. The frame size is the same for
every message of a run (``32 + max(numel * itemsize, TEXT_BYTES)``), so a receiver always
knows how much to receive, and a message costs one Gloo send instead of two:

=========  ==========  =====================================  ===============================
kind       direction   header fields                          body
=========  ==========  =====================================  ===============================
PULL       worker→PS   rank                                   unused
PUSH       worker→PS   rank, version computed on, local step  gradients, ``numel`` elements
DONE       worker→PS   rank                                   unused
ABORT      worker→PS   rank, -, text length                   error text, UTF-8
BYE        worker→PS   rank (after receiving STOP)            unused
PARAMS     PS→worker   rank, version, staleness of the push   parameters, ``numel`` elements
STOP       PS→worker   failed rank, -, text length            reason, UTF-8
WAIT       PS→worker   rank, version                          unused
=========  ==========  =====================================  ===============================

The protocol is strict request/reply: each PULL, PUSH or DONE gets exactly one PARAMS or STOP,
possibly preceded by WAIT heartbeats while the server holds the worker back; the server never
sends to a worker that is not waiting for it. That matters on Gloo, where a send blocks until
the peer posts the matching receive: a message always finds its worker waiting.
The same ``Message`` tuples travel through in-process queues between rank 0's training thread
and its server thread (the server cannot send to its own rank over Gloo).
"""

from __future__ import annotations

import queue
from datetime import timedelta
from enum import IntEnum
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..errors import DistributedError
from ..output.console import printable

TEXT_BYTES = 512
"""Size of the error-text payload of ABORT and STOP (UTF-8, truncated)."""


class Kind(IntEnum):
    PULL = 1
    PUSH = 2
    DONE = 3
    ABORT = 4
    BYE = 5
    LOST = 6  # never on the wire: a receiver thread's note that a worker vanished
    BAD = 7  # never on the wire: a receiver thread's note that a worker broke the protocol
    PARAMS = 10
    STOP = 11
    WAIT = 12


_FLAT_PAYLOAD = (Kind.PUSH, Kind.PARAMS)
_TEXT_PAYLOAD = (Kind.ABORT, Kind.STOP)
TO_SERVER = frozenset({Kind.PULL, Kind.PUSH, Kind.DONE, Kind.ABORT, Kind.BYE})
"""Kinds a worker may send (LOST is never on the wire)."""
TO_WORKER = frozenset({Kind.PARAMS, Kind.STOP, Kind.WAIT})
"""Kinds the server may send."""


class ProtocolError(DistributedError):
    """A frame that breaks the wire format: the peer, the field and its value are named."""

    def __init__(self, peer: int, field: str, value: object, expected: str) -> None:
        self.peer = peer
        self.field = field
        super().__init__(
            f"protocol error from rank {peer}: field {field!r} is {value!r}, expected {expected}",
            fix=f"every rank must run the same rankwise version and the same script; rank {peer} "
            "sent a frame that is not a rankwise parameter-server message (a different version, "
            "or a process that is not ours, is talking to this job).",
        )


class Message(NamedTuple):
    kind: Kind
    rank: int
    version: int = 0
    aux: int = 0
    payload: torch.Tensor | None = None
    text: str = ""


def text_message(kind: Kind, rank: int, text: str) -> Message:
    return Message(kind, rank, text=text)


def _encode_text(text: str) -> tuple[torch.Tensor, int]:
    raw = text.encode("utf-8")[:TEXT_BYTES]
    buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buf, len(raw)


def _decode_text(buf: torch.Tensor, length: int) -> str:
    raw = bytes(buf[: max(0, min(length, TEXT_BYTES))].tolist()).decode("utf-8", "replace")
    return printable(raw)


_HEADER_BYTES = 32  # 4 x int64; also keeps the body aligned for any dtype


class WireChannel:
    """Send and receive ``Message`` frames over a (Gloo) process group; the caller names the peer."""

    def __init__(self, group: dist.ProcessGroup, numel: int, dtype: torch.dtype) -> None:
        self.group = group
        self.numel = numel
        self.dtype = dtype
        self._flat_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.frame_bytes = _HEADER_BYTES + max(self._flat_bytes, TEXT_BYTES)

    def _frame(self, msg: Message) -> torch.Tensor:
        frame = torch.zeros(self.frame_bytes, dtype=torch.uint8)
        aux = msg.aux
        body = frame[_HEADER_BYTES:]
        if msg.kind in _FLAT_PAYLOAD:
            body[: self._flat_bytes].view(self.dtype).copy_(msg.payload.reshape(-1))
        elif msg.kind in _TEXT_PAYLOAD:
            text, aux = _encode_text(msg.text)
            body[:TEXT_BYTES].copy_(text)
        header = torch.tensor([int(msg.kind), msg.rank, msg.version, aux], dtype=torch.int64)
        frame[:_HEADER_BYTES].view(torch.int64).copy_(header)
        return frame

    def send(self, dst: int, msg: Message) -> None:
        """Blocking send (returns once the peer has received it, on Gloo)."""
        dist.send(self._frame(msg), dst=dst, group=self.group)

    def isend(self, dst: int, msg: Message, timeout: float) -> None:
        """Send that gives up after ``timeout`` s (for an ABORT, when the server may be gone)."""
        work = dist.isend(self._frame(msg), dst=dst, group=self.group)
        work.wait(timedelta(seconds=timeout))

    def recv(self, src: int, allowed: frozenset[Kind] = TO_WORKER) -> Message:
        """Blocking receive of one message from ``src``; raises on timeout or a lost peer,
        and ``ProtocolError`` when the frame breaks the format (the peer's rank is ``src``,
        whatever the header says: a rank is bound to its connection)."""
        frame = torch.empty(self.frame_bytes, dtype=torch.uint8)
        dist.recv(frame, src=src, group=self.group)
        return self.decode(frame, src, allowed)

    def decode(self, frame: torch.Tensor, peer: int, allowed: frozenset[Kind]) -> Message:
        """Validate every header field and parse one frame; allocates nothing frame-sized."""
        if frame.dtype != torch.uint8 or frame.numel() != self.frame_bytes:
            raise ProtocolError(peer, "frame length", frame.numel(), f"{self.frame_bytes} bytes")
        kind, rank, version, aux = frame[:_HEADER_BYTES].view(torch.int64).tolist()
        if kind not in {int(k) for k in allowed}:
            expected = "one of " + ", ".join(f"{k.name}={int(k)}" for k in sorted(allowed))
            raise ProtocolError(peer, "kind", kind, expected)
        kind = Kind(kind)
        if kind in TO_SERVER and rank != peer:
            raise ProtocolError(peer, "rank", rank, f"{peer}, the sender's own rank")
        if rank < 0:  # server to worker: the addressee, or for STOP the rank that failed
            raise ProtocolError(peer, "rank", rank, "a rank of this job")
        if version < 0:
            raise ProtocolError(peer, "version", version, "a non-negative parameter version")
        body = frame[_HEADER_BYTES:]
        if kind in _TEXT_PAYLOAD:
            if not 0 <= aux <= TEXT_BYTES:
                raise ProtocolError(peer, "text length", aux, f"0 to {TEXT_BYTES}")
            return Message(kind, rank, version, aux, text=_decode_text(body, aux))
        if aux < 0:
            raise ProtocolError(peer, "aux", aux, "a non-negative step or staleness")
        if kind in _FLAT_PAYLOAD:
            payload = body[: self._flat_bytes].view(self.dtype)
            return Message(kind, rank, version, aux, payload)
        return Message(kind, rank, version, aux)


class LocalChannel:
    """Rank 0's training thread talking to the server thread in the same process."""

    def __init__(self, inbox: queue.Queue, replies: queue.Queue) -> None:
        self.inbox = inbox
        self.replies = replies

    def request(self, msg: Message, timeout: float) -> Message:
        self.inbox.put(msg)
        return self.next_reply(timeout)

    def next_reply(self, timeout: float) -> Message:
        return self.replies.get(timeout=timeout)

    def notify(self, msg: Message) -> None:
        self.inbox.put(msg)
