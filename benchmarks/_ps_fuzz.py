"""Fuzzed frames against a live parameter server (helper of benchmarks/faults.py).

Worker 1's frames go through the real decoder (``WireChannel.decode``) into a real
``ParameterServer``; worker 0 trains in the server's process. After each fuzzed frame, worker 0
steps once: the server must answer it within 5 s (it never dies silently), and when the frame
broke the protocol, rank 1 must be sent a STOP within 5 s (the seconds reported), and worker
0's next step must be answered with a STOP naming rank 1.
"""

from __future__ import annotations

import queue
import random
import time

import torch

from rankwise.updates.protocol import TO_SERVER, Kind, Message, ProtocolError, WireChannel
from rankwise.updates.server import ParameterServer

NUMEL = 16


class MemoryWire(WireChannel):
    def __init__(self) -> None:
        super().__init__(None, NUMEL, torch.float32)
        self.frames: queue.Queue = queue.Queue()
        self.sent: queue.Queue = queue.Queue()

    def recv(self, src, allowed=TO_SERVER):
        return self.decode(self.frames.get(timeout=30), src, allowed)

    def send(self, dst, msg):
        self.sent.put((dst, msg))


def _random_frame(wire: MemoryWire, rng: random.Random) -> torch.Tensor:
    size = wire.frame_bytes
    style = rng.choice(["bytes", "header", "header", "length"])
    if style == "length":
        size = rng.choice([0, 1, 31, 32, size - 1, size + 1, size * 2])
    frame = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=_gen(rng))
    if style == "header" or (style == "length" and size >= 32):
        kind = rng.choice([*range(-1, 14), 2**40])
        rank = rng.choice([0, 1, 2, 7, -1, 2**62])
        version = rng.choice([0, 1, -3, 10**9])
        aux = rng.choice([0, 5, 512, 513, -1, 10**12])
        frame[:32].view(torch.int64).copy_(torch.tensor([kind, rank, version, aux]))
    return frame


def _gen(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(2**31))


def _trial(frame: torch.Tensor) -> dict:
    wire = MemoryWire()
    params = [torch.nn.Parameter(torch.zeros(NUMEL))]
    server = ParameterServer(params=params, optimizer=torch.optim.SGD(params, lr=0.1),
                             workers=[0, 1], local_worker=0, channel=wire, bound=None, rank=0,
                             timeout=30.0)  # fmt: skip
    server.start()
    server.inbox.put(Message(Kind.PULL, 0))
    server.local_replies.get(timeout=5)
    wire.frames.put(wire._frame(Message(Kind.PULL, 1)))
    wire.sent.get(timeout=5)
    try:
        wire.decode(frame, 1, TO_SERVER)
        bad = False
    except ProtocolError:
        bad = True
    start = time.monotonic()
    wire.frames.put(frame)
    if bad:  # the offender must be told, then worker 0 at its next step
        told = _stop_sent_to_1(wire, deadline=start + 5)
        took = time.monotonic() - start
        server.inbox.put(Message(Kind.PUSH, 0, 0, 0, torch.zeros(NUMEL)))
        reply = _reply(server)
        ok = told and reply is not None and reply.kind == Kind.STOP
        ok = ok and "protocol error from rank 1" in reply.text
        server.inbox.put(Message(Kind.BYE, 0))
    else:  # a valid frame: the server keeps serving worker 0
        time.sleep(0.002)
        server.inbox.put(Message(Kind.PUSH, 0, 0, 0, torch.zeros(NUMEL)))
        reply = _reply(server)
        took = time.monotonic() - start
        ok = reply is not None and reply.kind in (Kind.PARAMS, Kind.STOP)
        if reply is not None:
            last = Message(Kind.DONE, 0) if reply.kind == Kind.PARAMS else Message(Kind.BYE, 0)
            server.inbox.put(last)
        wire.frames.put(wire._frame(Message(Kind.DONE, 1)))
    return {"lost": False, "hung": not ok, "seconds": took if ok else None, "bad": bad}


def _stop_sent_to_1(wire: MemoryWire, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if any(d == 1 and m.kind == Kind.STOP for d, m in list(wire.sent.queue)):
            return True
        time.sleep(0.0005)
    return False


def _reply(server: ParameterServer) -> Message | None:
    try:
        return server.local_replies.get(timeout=5)
    except queue.Empty:
        return None


def run_fuzz(trials: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    wire = MemoryWire()
    return [_trial(_random_frame(wire, rng)) for _ in range(trials)]
