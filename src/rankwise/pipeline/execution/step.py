"""What a pipelined training step needs around the executor, for both pipeline front ends
(``DistributedPipeline`` and the model ``rt.prepare`` splits): the transport over processes,
the schedule for the step's micro-batch count, the loss weights, the loss shared with every
stage, the gradients landed in ``.grad``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .. import schedules
from ..schedules import Message, Schedule
from .p2p import Link
from .tables import stream_tag
from .wire import Expected, Header


class ProcessTransport:
    """The executor's transport over ``Link``: pipeline positions are the global ranks
    ``peers[position]``; every activation header must announce one of ``count`` micro-batches
    (``wire.decode`` refuses anything else, naming the sending stage)."""

    def __init__(self, link: Link, peers: Sequence[int], count: int | None = None) -> None:
        self.link, self.peers, self.count = link, list(peers), count

    def send(self, dst: int, msg: Message, tensor: torch.Tensor, header: Header | None) -> None:
        self.link.send(tensor, self.peers[dst], _what(msg), header, stream_tag(msg))

    def post(self) -> None:
        self.link.post()

    def expect(self, src: int, msg: Message, like: torch.Tensor | None) -> None:
        expected = self._expected(src, msg) if like is None else None
        self.link.expect(self.peers[src], like, expected, stream_tag(msg))

    def progress(self) -> None:
        self.link.progress()

    def receive(self, src: int, msg: Message, like: torch.Tensor | None) -> torch.Tensor:
        tag = stream_tag(msg)
        if like is not None:
            return self.link.recv(tuple(like.shape), like.dtype, self.peers[src], _what(msg), tag)
        expected = self._expected(src, msg)
        return self.link.receive_activation(self.peers[src], _what(msg), expected, tag)[1]

    def acked(self, dst: int, count: int) -> None:
        self.link.acked(self.peers[dst], count)

    def flush(self) -> None:
        self.link.flush()

    def _expected(self, src: int, msg: Message) -> Expected:
        sender = f"stage {msg.src_stage} (rank {self.peers[src]})"
        return Expected(sender, msg.micro_batch, self.count)


def _what(msg: Message) -> str:
    kind = "activation" if msg.kind == "act" else "gradient"
    return f"{kind} of micro-batch {msg.micro_batch} from stage {msg.src_stage}"


@functools.lru_cache(maxsize=64)
def schedule_for(name: str, ranks: int, micro_batches: int, stages_per_rank: int) -> Schedule:
    """The schedule of a step with ``micro_batches`` micro-batches (cached: pure)."""
    return schedules.make(name, ranks, micro_batches, stages_per_rank)


def first_activation(link: Link, peers: Sequence[int], position: int) -> tuple[int, dict]:
    """A stage that does not read the batch learns the step's micro-batch count from the
    header of the first activation it receives (every schedule starts each rank with the
    forward of micro-batch 0 of its first stage). Returns it with the message, set aside."""
    msg = Message("act", position - 1, 0)
    expected = Expected(f"stage {position - 1} (rank {peers[position - 1]})", 0)
    head, tensor = link.receive_activation(peers[position - 1], _what(msg), expected, stream_tag(msg))
    return head.num_micro_batches, {msg: tensor}


def loss_weights(sizes: Sequence[int], reduction: str) -> list[float]:
    """How much each micro-batch's loss weighs in the batch loss: its share of the samples
    for a mean, 1 for a sum."""
    total = sum(sizes)
    if reduction == "sum" or total == 0:
        return [1.0] * len(sizes)
    return [s / total for s in sizes]


def batch_loss(losses: dict[int, torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    return sum(w * losses[i].float() for i, w in enumerate(weights))  # type: ignore[return-value]


def share_loss(
    link: Link, peers: Sequence[int], position: int, loss: torch.Tensor | None
) -> torch.Tensor:
    """The batch loss, sent by the last stage to every other stage of the pipeline, so that
    each rank returns (and logs, prints) the same number. Sync point: the pipeline's ranks."""
    last = len(peers) - 1
    if position == last:
        value = loss.detach().to(torch.float64).reshape(1)
        for peer in peers[:last]:
            link.send(value, peer, "batch loss", None)
        link.flush()
        return loss.detach()
    got = link.recv((1,), torch.float64, peers[last], "batch loss")
    return got.reshape(()).to(torch.float32)


def share_loss_and_shape(
    link: Link, peers: Sequence[int], position: int, loss: torch.Tensor | None, shape: Any
) -> tuple[torch.Tensor | None, Any]:
    """``share_loss`` for ``PipelineModel``: with the loss (which may be absent: an
    evaluation without targets) goes the structure of the model's output
    (``outputs.Outputs``), so that every stage returns the same structure."""
    from ..outputs import Outputs

    last = len(peers) - 1
    if position == last:
        value = float("nan") if loss is None else float(loss.detach())
        packed = torch.tensor([value, loss is not None, shape.kind, shape.length,
                               shape.loss_index], dtype=torch.float64)  # fmt: skip
        for peer in peers[:last]:
            link.send(packed, peer, "batch loss", None)
        link.flush()
        return (None if loss is None else loss.detach()), shape
    got = link.recv((5,), torch.float64, peers[last], "batch loss").tolist()
    shape = Outputs(int(got[2]), int(got[3]), int(got[4]))
    return (torch.tensor(got[0], dtype=torch.float32) if got[1] else None), shape


def land_grads(params: Iterable[nn.Parameter], grads: dict[int, torch.Tensor], scale: float = 1.0) -> None:
    """Add the step's gradients to ``.grad`` (a parameter without one keeps what it had)."""
    for p in params:
        g = grads.pop(id(p), None)
        if g is None:
            continue
        if scale != 1.0:
            g = g.mul_(scale)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)


def micro_batches(x: Any, chunks: int) -> list[Any]:
    """``x`` cut into at most ``chunks`` non-empty micro-batches along dimension 0 (sizes
    differ by at most one); an empty batch stays one micro-batch."""
    parts = [mb for mb in torch.tensor_split(x, chunks, dim=0) if mb.shape[0] > 0]
    return parts or [x]
