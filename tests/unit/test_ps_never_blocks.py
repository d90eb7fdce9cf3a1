"""The parameter server never blocks on one worker, refuses non-finite pushes, escapes text.

The wire is an in-memory channel (as in test_ps_protocol_faults.py) whose send to one worker
blocks the way a Gloo send does when that worker never posts its receive.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_ps_protocol_faults import NUMEL, _frame, _MemoryWire, _server_with

from rankwise.errors import ConfigError
from rankwise.updates.asynchronous import _check_seconds
from rankwise.updates.protocol import Kind, Message


class _DeafWire(_MemoryWire):
    """Sends to rank 1 never complete (rank 1 pushed, then stopped receiving)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def send(self, dst, msg):
        if dst == 1 and not self.release.is_set():
            self.release.wait(60)
            return  # the stuck reply: delivered once rank 1 receives again
        super().send(dst, msg)


def _local_step(server, kind=Kind.PUSH, grads=None, version=0) -> Message:
    payload = torch.zeros(NUMEL) if grads is None else grads
    server.inbox.put(Message(kind, 0, version, 0, payload if kind == Kind.PUSH else None))
    return server.local_replies.get(timeout=10)


def test_a_worker_that_stops_receiving_is_dropped_and_the_others_train_on():
    """Was: the worker was reported only after the whole timeout (30 s, 300 s by default), and
    its report stopped every other worker. Now it is dropped after its own stall window (8 s
    by default, here the default under a 60 s timeout) and rank 0 trains on; if it comes back,
    its next request is answered with STOP."""
    wire = _DeafWire()
    server = _server_with(wire, timeout=60.0)
    try:
        assert _local_step(server, Kind.PULL).kind == Kind.PARAMS
        wire.frames[1].put(_frame(wire, Kind.PULL, 1))  # its reply never gets through
        reply = _local_step(server)
        deadline = time.monotonic() + 55  # a STOP or no drop before the timeout: a failure
        while not server.stats().dropped and time.monotonic() < deadline:
            assert reply.kind == Kind.PARAMS, reply.text  # rank 0 is never stopped
            time.sleep(0.2)
            reply = _local_step(server, version=reply.version)
        why = server.stats().dropped[1]
        assert "worker rank 1 stopped receiving" in why and "stall_timeout 8s" in why
        for _ in range(3):  # training goes on after the drop
            reply = _local_step(server, version=reply.version)
            assert reply.kind == Kind.PARAMS, reply.text
        wire.release.set()  # it comes back: its stuck reply arrives, then it pushes again
        wire.frames[1].put(_frame(wire, Kind.PUSH, 1))
        dst, stop = wire.sent.get(timeout=10)
        assert (dst, stop.kind, stop.rank) == (1, Kind.STOP, 1)
        assert "it was dropped and the others trained on without it" in stop.text
        server.inbox.put(Message(Kind.DONE, 0))
        assert server.local_replies.get(timeout=10).kind == Kind.PARAMS  # the final parameters
        assert server.join(10.0)
    finally:
        wire.release.set()


def test_the_stall_window_is_configurable_and_checked():
    wire = _DeafWire()
    server = _server_with(wire, timeout=60.0, stall_timeout=1.5)
    try:
        assert _local_step(server, Kind.PULL).kind == Kind.PARAMS
        wire.frames[1].put(_frame(wire, Kind.PULL, 1))
        deadline = time.monotonic() + 30
        while not server.stats().dropped and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "(stall_timeout 1.5s)" in server.stats().dropped[1]
    finally:
        wire.release.set()
    with pytest.raises(ConfigError, match="stall_timeout=0 must be a positive number"):
        _check_seconds("stall_timeout", 0, "fix")


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
