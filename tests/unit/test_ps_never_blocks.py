"""The parameter server never blocks on one worker, refuses non-finite pushes, escapes text.

The wire is an in-memory channel (as in test_ps_protocol_faults.py) whose send to one worker
blocks the way a Gloo send does when that worker never posts its receive.
"""

from __future__ import annotations

import threading
import time

import torch
from test_ps_protocol_faults import NUMEL, _frame, _MemoryWire, _server_with

from rankwise.updates.protocol import Kind, Message


class _DeafWire(_MemoryWire):
    """Sends to rank 1 never complete (rank 1 pushed, then stopped receiving)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def send(self, dst, msg):
        if dst == 1:
            self.release.wait(60)
            return
        super().send(dst, msg)


def _local_step(server, kind=Kind.PUSH, grads=None, version=0) -> Message:
    payload = torch.zeros(NUMEL) if grads is None else grads
    server.inbox.put(Message(kind, 0, version, 0, payload if kind == Kind.PUSH else None))
    return server.local_replies.get(timeout=10)


def test_a_worker_that_stops_receiving_neither_freezes_the_others_nor_goes_unreported():
    wire = _DeafWire()
    server = _server_with(wire, timeout=2.0)
    try:
        assert _local_step(server, Kind.PULL).kind == Kind.PARAMS
        wire.frames[1].put(_frame(wire, Kind.PULL, 1))  # its reply never gets through
        time.sleep(0.3)
        # Rank 0 trains on while the reply to rank 1 waits (it used to freeze the loop).
        replies = [_local_step(server, version=i) for i in range(3)]
        assert [r.kind for r in replies] == [Kind.PARAMS] * 3
        deadline = time.monotonic() + 20
        reply = replies[-1]
        while reply.kind != Kind.STOP and time.monotonic() < deadline:
            time.sleep(0.2)
            reply = _local_step(server, version=reply.version)
        assert reply.kind == Kind.STOP and reply.rank == 1
        assert "worker rank 1 stopped receiving" in reply.text and "timeout 2s" in reply.text
        server.inbox.put(Message(Kind.BYE, 0))
        assert server.join(10.0)
    finally:
        wire.release.set()


def test_a_non_finite_push_is_refused_naming_the_rank_and_never_applied():
    wire = _MemoryWire()
    server = _server_with(wire, timeout=30.0)
    assert _local_step(server, Kind.PULL).kind == Kind.PARAMS
    wire.frames[1].put(_frame(wire, Kind.PULL, 1))
    assert wire.sent.get(timeout=5)[1].kind == Kind.PARAMS
    frame = _frame(wire, Kind.PUSH, 1)
    frame[32:].view(torch.float32)[:NUMEL] = torch.tensor(
        [1.0, float("nan"), 0, float("inf"), 0, 0]
    )
    wire.frames[1].put(frame)
    dst, stop = wire.sent.get(timeout=5)
    assert (dst, stop.kind, stop.rank) == (1, Kind.STOP, 1)
    assert "worker rank 1 pushed non-finite gradients (2 of 6 elements NaN or Inf" in stop.text
    assert torch.equal(server.values(), torch.zeros(NUMEL))  # nothing applied
    assert server.stats().gradients == 0
    local = _local_step(server)
    assert local.kind == Kind.STOP and local.text == stop.text
    server.inbox.put(Message(Kind.BYE, 0))
    assert server.join(5.0)


def test_the_local_workers_non_finite_push_is_refused_too():
    server = _server_with(_MemoryWire(), timeout=30.0)
    assert _local_step(server, Kind.PULL).kind == Kind.PARAMS
    reply = _local_step(server, grads=torch.full((NUMEL,), float("-inf")))
    assert reply.kind == Kind.STOP and "worker rank 0 pushed non-finite gradients" in reply.text
    assert torch.isfinite(server.values()).all()


def test_echoed_abort_text_has_its_control_characters_escaped():
    wire = _MemoryWire()
    evil = "boom\x1b]0;owned\x07\x1b[2J \u202eevil\u2066 end"
    msg = wire.decode(wire._frame(Message(Kind.ABORT, 1, text=evil)), 1, frozenset({Kind.ABORT}))
    assert msg.text == "boom\\x1b]0;owned\\x07\\x1b[2J \\u202eevil\\u2066 end"
    assert msg.text.isprintable()
