"""The parameter server against bad frames: every field validated, the server never dies silently.

The wire is replaced by an in-memory channel that feeds the server's receiver threads raw
frames through the real decoder (``WireChannel.decode``): the same path a Gloo receive takes.
"""

from __future__ import annotations

import queue
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwise.updates.protocol import (
    TEXT_BYTES,
    TO_SERVER,
    Kind,
    Message,
    ProtocolError,
    WireChannel,
)
from rankwise.updates.server import ParameterServer

NUMEL = 6


class _MemoryWire(WireChannel):
    """A WireChannel whose receive reads raw frames from queues instead of Gloo."""

    def __init__(self) -> None:
        super().__init__(None, NUMEL, torch.float32)
        self.frames: dict[int, queue.Queue] = {1: queue.Queue()}
        self.sent: queue.Queue = queue.Queue()

    def recv(self, src, allowed=TO_SERVER):
        frame = self.frames[src].get(timeout=30)
        return self.decode(frame, src, allowed)

    def send(self, dst, msg):
        self.sent.put((dst, msg))


def _frame(wire, kind, rank, version=0, aux=0) -> torch.Tensor:
    frame = wire._frame(Message(Kind.PULL, 0))
    frame[:32].view(torch.int64).copy_(torch.tensor([kind, rank, version, aux]))
    return frame


def _server(wire) -> ParameterServer:
    return _server_with(wire, timeout=30.0)


def _server_with(wire, *, timeout: float, **options) -> ParameterServer:
    params = [torch.nn.Parameter(torch.zeros(NUMEL))]
    server = ParameterServer(
        params=params,
        optimizer=torch.optim.SGD(params, lr=0.1),
        workers=[0, 1],
        local_worker=0,
        channel=wire,
        bound=None,
        rank=0,
        timeout=timeout,
        **options,
    )
    server.start()
    return server


BAD_FRAMES = {
    "rank of no worker": (dict(kind=Kind.PUSH, rank=7), "field 'rank' is 7, expected 1"),
    "another valid rank": (dict(kind=Kind.PUSH, rank=0), "field 'rank' is 0, expected 1"),
    "unknown kind": (dict(kind=99, rank=1), "field 'kind' is 99"),
    "server-only kind": (dict(kind=Kind.PARAMS, rank=1), "field 'kind' is 10"),
    "never-on-wire kind": (dict(kind=Kind.LOST, rank=1), "field 'kind' is 6"),
    "negative version": (dict(kind=Kind.PUSH, rank=1, version=-5), "field 'version' is -5"),
    "future version": (dict(kind=Kind.PUSH, rank=1, version=10**9), "field 'version'"),
    "text length": (dict(kind=Kind.ABORT, rank=1, aux=10**12), "field 'text length'"),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_a_bad_frame_stops_every_worker_naming_the_peer_and_field(case):
    fields, expected = BAD_FRAMES[case]
    wire = _MemoryWire()
    server = _server(wire)
    server.inbox.put(Message(Kind.PULL, 0))  # rank 0 (local) is training
    assert server.local_replies.get(timeout=5).kind == Kind.PARAMS
    wire.frames[1].put(_frame(wire, Kind.PULL, 1))
    assert wire.sent.get(timeout=5)[1].kind == Kind.PARAMS
    started = time.monotonic()
    wire.frames[1].put(_frame(wire, **fields))
    dst, stop = wire.sent.get(timeout=5)  # the offender is told too, not left waiting
    assert (dst, stop.kind) == (1, Kind.STOP)
    assert f"protocol error from rank 1: {expected}" in stop.text, stop.text
    server.inbox.put(Message(Kind.PUSH, 0, 0, 0, torch.zeros(NUMEL)))  # rank 0's next step
    local = server.local_replies.get(timeout=5)
    assert local.kind == Kind.STOP and local.text == stop.text and local.rank == 1
    server.inbox.put(Message(Kind.BYE, 0))
    assert server.join(5.0), "the server loop did not end after the protocol error"
    assert time.monotonic() - started < 5.0
    assert server.failure.rank == 1


def test_a_wrong_length_frame_is_a_protocol_error():
    wire = _MemoryWire()
    with pytest.raises(ProtocolError, match="field 'frame length' is 10"):
        wire.decode(torch.zeros(10, dtype=torch.uint8), 1, TO_SERVER)


_WIRE = _MemoryWire()
_KINDS = st.sampled_from([*range(-2, 14), 2**40, -(2**62)])
_INTS = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-3, TEXT_BYTES + 3))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=st.tuples(_KINDS, _INTS, _INTS, _INTS),
    body=st.binary(max_size=64),
    cut=st.one_of(st.none(), st.integers(0, _WIRE.frame_bytes + 40)),
    peer=st.integers(0, 3),
)
def test_fuzzed_frames_decode_or_raise_protocol_error_only(header, body, cut, peer):
    frame = torch.zeros(_WIRE.frame_bytes, dtype=torch.uint8)
    frame[:32].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
    frame[32 : 32 + len(body)] = torch.tensor(list(body), dtype=torch.uint8)
    if cut is not None:  # truncated or over-long frames
        frame = torch.cat([frame, torch.zeros(40, dtype=torch.uint8)])[:cut]
    try:
        msg = _WIRE.decode(frame, peer, TO_SERVER)
    except ProtocolError as exc:
        assert exc.peer == peer and f"protocol error from rank {peer}" in str(exc)
        return
    assert msg.kind in TO_SERVER and msg.rank == peer and msg.version >= 0
    if msg.payload is not None:  # a view into the one frame, never a new allocation
        assert msg.payload.numel() == NUMEL
        assert msg.payload.untyped_storage().data_ptr() == frame.untyped_storage().data_ptr()
    # control and format characters arrive escaped (4 characters for one byte at most)
    assert len(msg.text) <= 4 * TEXT_BYTES and msg.text.isprintable()
