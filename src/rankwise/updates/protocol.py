"""The parameter server's wire format: a fixed tensor schema, no pickle.

Every message is an int64 header ``[kind, rank, version, aux]`` followed by at most one payload
whose shape the kind fixes:

=========  ==========  =====================================  ===============================
kind       direction   header fields                          payload
=========  ==========  =====================================  ===============================
PULL       worker→PS   rank                                   none
PUSH       worker→PS   rank, version computed on, local step  gradients, ``numel`` elements
DONE       worker→PS   rank                                   none
ABORT      worker→PS   rank, -, text length                   error text, ``TEXT_BYTES`` uint8
BYE        worker→PS   rank (after receiving STOP)            none
PARAMS     PS→worker   rank, version, staleness of the push   parameters, ``numel`` elements
STOP       PS→worker   failed rank, -, text length            reason, ``TEXT_BYTES`` uint8
=========  ==========  =====================================  ===============================

The protocol is strict request/reply: each PULL, PUSH or DONE gets exactly one PARAMS or STOP,
and the server never sends unsolicited messages. That matters on Gloo, where a send blocks
until the peer posts the matching receive: a reply always finds its worker waiting.
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

TEXT_BYTES = 512
"""Size of the error-text payload of ABORT and STOP (UTF-8, truncated)."""


class Kind(IntEnum):
    PULL = 1
    PUSH = 2
    DONE = 3
    ABORT = 4
    BYE = 5
    LOST = 6  # never on the wire: a receiver thread's note that a worker vanished
    PARAMS = 10
    STOP = 11


_FLAT_PAYLOAD = (Kind.PUSH, Kind.PARAMS)
_TEXT_PAYLOAD = (Kind.ABORT, Kind.STOP)


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
    return bytes(buf[: max(0, min(length, TEXT_BYTES))].tolist()).decode("utf-8", "replace")


class WireChannel:
    """Send and receive ``Message`` over a (Gloo) process group; the caller names the peer."""

    def __init__(self, group: dist.ProcessGroup, numel: int, dtype: torch.dtype) -> None:
        self.group = group
        self.numel = numel
        self.dtype = dtype

    def send(self, dst: int, msg: Message) -> None:
        """Blocking send (returns once the peer has received it, on Gloo)."""
        aux, payload = msg.aux, msg.payload
        if msg.kind in _TEXT_PAYLOAD:
            payload, aux = _encode_text(msg.text)
        header = torch.tensor([int(msg.kind), msg.rank, msg.version, aux], dtype=torch.int64)
        dist.send(header, dst=dst, group=self.group)
        if msg.kind in _FLAT_PAYLOAD:
            dist.send(payload.to("cpu", self.dtype).contiguous(), dst=dst, group=self.group)
        elif msg.kind in _TEXT_PAYLOAD:
            dist.send(payload, dst=dst, group=self.group)

    def isend_text(self, dst: int, msg: Message, timeout: float) -> None:
        """Best-effort send of an ABORT: gives up after ``timeout`` instead of blocking."""
        payload, aux = _encode_text(msg.text)
        header = torch.tensor([int(msg.kind), msg.rank, msg.version, aux], dtype=torch.int64)
        for t in (header, payload):
            work = dist.isend(t, dst=dst, group=self.group)
            work.wait(timedelta(seconds=timeout))

    def recv(self, src: int) -> Message:
        """Blocking receive of one message from ``src``; raises on timeout or a lost peer."""
        header = torch.empty(4, dtype=torch.int64)
        dist.recv(header, src=src, group=self.group)
        kind, rank, version, aux = (int(v) for v in header.tolist())
        kind = Kind(kind)
        if kind in _FLAT_PAYLOAD:
            payload = torch.empty(self.numel, dtype=self.dtype)
            dist.recv(payload, src=src, group=self.group)
            return Message(kind, rank, version, aux, payload)
        if kind in _TEXT_PAYLOAD:
            buf = torch.empty(TEXT_BYTES, dtype=torch.uint8)
            dist.recv(buf, src=src, group=self.group)
            return Message(kind, rank, version, aux, text=_decode_text(buf, aux))
        return Message(kind, rank, version, aux)


class LocalChannel:
    """Rank 0's training thread talking to the server thread in the same process."""

    def __init__(self, inbox: queue.Queue, replies: queue.Queue) -> None:
        self.inbox = inbox
        self.replies = replies

    def request(self, msg: Message, timeout: float) -> Message:
        self.inbox.put(msg)
        return self.replies.get(timeout=timeout)

    def notify(self, msg: Message) -> None:
        self.inbox.put(msg)
