"""When one rank's executor posts its receives: before the action that needs the message (so
the message lands while the rank computes), and over Gloo in the same burst of calls as a send
to the same peer (a receive posted on its own makes one more wake-up of the peer's
communication thread). Checked on each position alone, with a transport that records the
calls in order and hands over messages at once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.pipeline import schedules as S
from rankwise.pipeline.execution.executor import Executor
from rankwise.pipeline.execution.step import stream_tag
from rankwise.pipeline.execution.weight_pass import WeightPass

WIDTH, ROWS = 4, 2


class Recorder:
    """A transport that posts at most one receive per tag (as ``p2p.Link`` does over Gloo) and
    logs ``(what, peer, message)`` in call order, with ``("compute", ...)`` between actions."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int | None, S.Message | None]] = []
        self.posted: dict[tuple[int, int], S.Message] = {}
        self.late: list[S.Message] = []

    def send(self, dst, msg, tensor, header) -> None:
        self.log.append(("send", dst, msg))

    def post(self) -> None:
        pass

    def expect(self, src, msg, like) -> None:
        if (src, stream_tag(msg)) not in self.posted:
            self.posted[(src, stream_tag(msg))] = msg
            self.log.append(("post", src, msg))

    def progress(self) -> None:
        pass

    def receive(self, src, msg, like) -> torch.Tensor:
        if self.posted.pop((src, stream_tag(msg)), None) != msg:
            self.late.append(msg)  # posted when needed, not ahead
        return torch.zeros(ROWS, WIDTH) if like is None else torch.zeros_like(like)

    def acked(self, dst, count) -> None:
        pass

    def flush(self) -> None:
        pass


class Stages:
    def __init__(self, schedule: S.Schedule, position: int, log: list) -> None:
        torch.manual_seed(0)
        self.mods = {s: nn.Linear(WIDTH, WIDTH) for s in schedule.stages_of(position)}
        self.log = log

    def run(self, stage, micro_batch, x):
        self.log.append(("compute", None, None))
        out = self.mods[stage](x)
        out.register_hook(self._backward)  # marks the backward's computation in the log
        return out

    def _backward(self, grad):
        self.log.append(("compute", None, None))

    def first_input(self, micro_batch):
        return torch.ones(ROWS, WIDTH)

    def loss(self, micro_batch, output):
        return output.sum()

    def parameters_of(self, stage):
        return list(self.mods[stage].parameters())


def _run(name: str, ranks: int, m: int, v: int, position: int) -> Recorder:
    schedule = S.make(name, ranks, m, v)
    rec = Recorder()
    stages = Stages(schedule, position, rec.log)
    split = WeightPass(list(stages.mods.values())) if schedule.split_backward else None
    Executor(schedule, position, stages, rec, weight_pass=split).run()
    return rec


def _bursts(log: list) -> list[list]:
    """The calls between two computations."""
    out: list[list] = [[]]
    for entry in log:
        if entry[0] == "compute":
            out.append([])
        else:
            out[-1].append(entry)
    return out


def _alone(name: str, ranks: int, m: int, v: int, position: int) -> int:
    """Bursts past the first computation that post a receive from a peer they send nothing
    to: each one more wake-up of that peer's communication thread."""
    count = 0
    for burst in _bursts(_run(name, ranks, m, v, position).log)[1:]:
        sent_to = {peer for what, peer, _ in burst if what == "send"}
        count += any(what == "post" and peer not in sent_to for what, peer, _ in burst)
    return count


CASES = [("1f1b", 2, 1), ("1f1b", 3, 1), ("1f1b", 4, 1), ("gpipe", 2, 1), ("zero_bubble", 2, 1),
         ("zero_bubble", 4, 1), ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2),
         ("zero_bubble", 2, 2), ("zero_bubble", 4, 2)]  # fmt: skip


@pytest.mark.parametrize(("name", "ranks", "v"), CASES)
def test_every_receive_is_posted_before_the_action_that_needs_it(name, ranks, v):
    for position in range(ranks):
        rec = _run(name, ranks, 8, v, position)
        assert rec.late == [], (position, rec.late)


@pytest.mark.parametrize(("name", "ranks", "v"), [c for c in CASES if c[0] != "gpipe"])
def test_receives_go_out_with_a_send_to_the_same_peer(name, ranks, v):
    """In training a rank sends back to every peer it reads from, so its receives can go out
    with those sends. With one stage per rank, a receive is posted on its own at most twice a
    step (zero bubble's first stages, in the warm-up), however many micro-batches (before:
    after every forward of a later stage, and every backward of an earlier one); with two
    stages per rank, fewer times than there are micro-batches
    (before: about three times as many at 4 ranks). GPipe is left out: its first stage sends
    nothing during the backward phase, where it reads every gradient."""
    for position in range(ranks):
        at8, at16 = _alone(name, ranks, 8, v, position), _alone(name, ranks, 16, v, position)
        if v == 1:
            assert at8 == at16 <= 2, (position, at8, at16)
        else:
            assert at16 <= 16, (position, at16)


def test_an_activations_receive_without_its_micro_batch_is_refused():
    """Both ends guess an activation's shape from its micro-batch's last one: a header
    receive posted without saying which micro-batch would guess differently from its sender."""
    from datetime import timedelta

    from rankwise.pipeline.execution.p2p import Link

    with pytest.raises(ValueError, match="Expected micro-batch"):
        Link(torch.device("cpu"), timedelta(seconds=1), 0).expect(1, None, None)
