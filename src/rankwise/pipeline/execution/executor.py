"""One executor for every schedule: run one rank's actions, moving tensors between stages.

The schedule (``pipeline/schedules.py``) says what to compute and in which order; ``Stages`` says how
(this rank's stage modules, the first stage's micro-batch inputs, the last stage's loss); a
``Transport`` moves tensors (``p2p.Link`` between processes). For each action:

- ``F``: take the input (the micro-batch, or the activation received from the previous
  stage), run the stage, send the output on (with its header) or, on the last stage, keep the
  loss;
- ``B``: ``torch.autograd.grad`` of the stage output with the received gradient (the last
  stage: the loss with its seed), for the stage input and the stage's parameters; send the
  input's gradient back;
- ``I``/``W`` (zero-bubble): the same split in two by ``weight_pass.WeightPass`` (on the first
  stage, whose input needs no gradient, ``I`` is the whole backward and ``W`` does nothing).

Parameter gradients are summed into ``StepResult.grads`` (one tensor per parameter), never
into ``.grad``: the caller decides when they land there (all at once, so that a data-parallel
engine's gradient hooks fire once per step, as after one ordinary backward).

Messages between two ranks are read in the order they were sent (``Schedule.sends``): a
message that arrives before the one this rank needs now is set aside until its turn. Their
receives are posted ahead, the next message of each stream (``tables.stream_tag``: of each
kind, the next two), and with a send to the same peer where one comes before the message is
needed (``tables.deferred_posts``): over Gloo a receive posted on its own wakes the peer's
communication thread once more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...errors import ConfigError
from ...timing import clock as timing
from ..schedules import Action, Message, Schedule
from .tables import deferred_posts, firsts, tables
from .weight_pass import WeightPass
from .wire import Header

KEPT_SENDS = 2
"""Activations a stage keeps sent and unconfirmed in a forward-only pass (one stage per rank):
the one its next stage is reading and the one after it."""


class Stages(Protocol):
    """What one rank computes."""

    def run(self, stage: int, micro_batch: int, x: Any) -> Any:
        """Stage ``stage``'s forward of ``x`` (the first stage gets ``first_input``)."""

    def first_input(self, micro_batch: int) -> Any:
        """The first stage's input for ``micro_batch``."""

    def loss(self, micro_batch: int, output: Any) -> torch.Tensor:
        """The last stage's scalar loss from its output."""

    def parameters_of(self, stage: int) -> list[torch.nn.Parameter]:
        """The trainable parameters ``stage`` uses."""


class Transport(Protocol):
    """Moves tensors between the pipeline's positions (0 = the first rank)."""

    def send(self, dst: int, msg: Message, tensor: torch.Tensor, header: Header | None) -> None:
        """Queue ``tensor`` for position ``dst`` (activations carry a header)."""

    def post(self) -> None:
        """Start the queued sends."""

    def receive(self, src: int, msg: Message, like: torch.Tensor | None) -> torch.Tensor:
        """The next message from ``src`` (it is ``msg``): shaped as ``like``, or by its header."""

    def expect(self, src: int, msg: Message, like: torch.Tensor | None) -> None:
        """The next message of ``msg``'s stream from ``src`` (it is ``msg``: the same kind,
        from the same stage) may be received ahead: shaped as ``like``, or (None) an
        activation with its header. Messages of other streams from ``src`` may come first."""

    def progress(self) -> None:
        """Move receives posted ahead along (between actions)."""

    def acked(self, dst: int, count: int) -> None:
        """Free the first ``count`` messages sent to position ``dst`` this step, waiting for
        any not yet received (none, when ``dst`` has acknowledged them)."""

    def flush(self) -> None:
        """Wait until every send has been received."""


@dataclass
class Event:
    """One action as it ran on this rank (``time.perf_counter`` seconds)."""

    action: Action
    start: float
    end: float


@dataclass
class StepResult:
    """What one rank's step produced."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Last stage: each micro-batch's loss (detached)."""
    outputs: dict[int, Any] = field(default_factory=dict)
    """Forward-only runs, last stage: each micro-batch's output."""
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """id(parameter) -> its gradient summed over the micro-batches (seeded as asked)."""
    events: list[Event] = field(default_factory=list)
    recv_wait_s: float = 0.0
    """Time spent waiting for messages: this rank's measured bubble."""


class Executor:
    """Runs ``schedule`` as pipeline position ``position``."""

    def __init__(
        self,
        schedule: Schedule,
        position: int,
        stages: Stages,
        transport: Transport,
        seed: Callable[[int], float] = lambda i: 1.0,
        weight_pass: WeightPass | None = None,
        prefetched: dict[Message, torch.Tensor] | None = None,
    ) -> None:
        self.split = schedule.split_backward
        if self.split and weight_pass is None:
            raise ValueError("a split-backward schedule needs a WeightPass")
        self.schedule, self.position, self.stages = schedule, position, stages
        self.transport, self.seed, self.weight_pass = transport, seed, weight_pass
        self.last = schedule.num_stages - 1
        self.stash: dict[Message, torch.Tensor] = dict(prefetched or {})
        self.read = {src: 0 for src in range(schedule.ranks)}
        self.channels, self.acks, self.firsts = tables(schedule, position)
        for msg in self.stash:
            self.read[schedule.rank_of(msg.src_stage)] += 1
        self.freed = dict.fromkeys(self.channels, 0)
        self.saved: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self.sent: dict[int, int] | None = None  # activations sent per rank, when bounded
        self.result = StepResult()

    def run(self, forward_only: bool = False) -> StepResult:
        """Every action of this rank (only the ``F`` ones with ``forward_only``), then wait
        for the sends. Sync point: the pipeline's ranks."""
        todo = (self.schedule.forward_only(self.position) if forward_only
                else self.schedule.actions[self.position])  # fmt: skip
        if forward_only:  # only activations are sent, none back to acknowledge them
            self.channels = {src: [m for m in ch if m.kind == "act"]
                             for src, ch in self.channels.items()}  # fmt: skip
            self.acks, self.firsts = {}, firsts(self.channels)
            # One stage per rank: the stages form a chain, each waiting only on the one before,
            # so waiting for an old send (done once the next stage posted its receive, which
            # it does without waiting on us) cannot deadlock: keep the last KEPT_SENDS, not
            # the whole batch's output. With several stages per rank the last rank feeds the
            # first: such a wait could close a cycle, so those are held until the flush.
            if self.schedule.num_stages == self.schedule.ranks:
                self.sent = dict.fromkeys(range(self.schedule.ranks), 0)
        for src in self.channels:
            self._expect(src)
        deferred = deferred_posts(self.schedule, self.position, todo, forward_only)
        for k, action in enumerate(todo):
            after = self.schedule.needs(todo[k + 1]) if k + 1 < len(todo) else None
            soon = None if after is None else self.schedule.rank_of(after.src_stage)
            self._act(action, forward_only, soon, deferred[k])
        with timing.span("blocked"):  # the sends' last bytes: the pipeline's drain
            self.transport.flush()
        return self.result

    def _act(self, action: Action, forward_only: bool, soon: int | None, deferred: bool) -> None:
        """Run ``action``; ``soon``: the rank the next action reads from, if any; ``deferred``:
        the next receives from the rank it reads from go out with a send to it
        (``tables.deferred_posts``), not after it."""
        self.transport.progress()
        needed = self.schedule.needs(action)
        with timing.span("blocked"):  # waiting for a neighbour stage: this rank's bubble
            received = self._take(needed, soon) if needed is not None else None
        if needed is None:
            self.transport.post()
        start = time.perf_counter()
        with timing.span("forward" if action.kind == "F" else "backward"):
            if action.kind == "F":
                self._forward(action, received, forward_only)
            elif action.kind == "W":
                self._add_grads(self.weight_pass.run((action.stage, action.micro_batch)))
            else:
                self._backward(action, received)
        self.result.events.append(Event(action, start, time.perf_counter()))
        if needed is not None:  # after the computation, not between the message and it
            src = self.schedule.rank_of(needed.src_stage)
            if src != self.position:
                self._release(src)
                if src != soon and not deferred:  # else _take posted it, or _send will
                    self._expect(src)

    def _forward(self, action: Action, received: Any, forward_only: bool) -> None:
        s, i = action.stage, action.micro_batch
        x = self.stages.first_input(i) if s == 0 else received
        if isinstance(x, torch.Tensor) and s > 0 and x.is_floating_point() and not forward_only:
            x = x.detach().requires_grad_(True)
        # the first stage's input needs no gradient: nobody waits for its I pass, so it runs
        # the whole backward there (one autograd pass; its W does nothing) instead of paying
        # the split's per-layer autograd calls
        split = self.split and not forward_only and s > 0
        anchor = self.weight_pass.begin((s, i)) if split else None
        try:
            out = self.stages.run(s, i, x)
        finally:
            if split:
                self.weight_pass.end()
        if s == self.last:
            if forward_only:
                self.result.outputs[i] = out
                return
            out = self.stages.loss(i, out)
            self.result.losses[i] = out.detach()
        if not forward_only:  # before the send: it posts the receive of out's gradient
            self.saved[(s, i)] = (x, out, anchor)
        if s != self.last:
            self._send(Message("act", s, i), _activation(out, s, forward_only), with_header=True)

    def _backward(self, action: Action, received: torch.Tensor | None) -> None:
        s, i = action.stage, action.micro_batch
        x, out, anchor = self.saved.pop((s, i))
        grad = torch.full_like(out, self.seed(i)) if s == self.last else received.to(out.device)
        takes_grad = isinstance(x, torch.Tensor) and x.requires_grad
        head = ([anchor] if anchor is not None else []) + ([x] if takes_grad else [])
        params = self.stages.parameters_of(s)
        if not out.requires_grad or not (head or params):  # a frozen first stage
            if s > 0:
                self._send(Message("grad", s, i), torch.zeros_like(x), False)
            return
        grads = torch.autograd.grad([out], head + params, [grad], allow_unused=True)
        self._add_grads(zip(params, grads[len(head) :], strict=True))
        if s > 0:
            dx = grads[len(head) - 1] if takes_grad else None
            self._send(Message("grad", s, i), torch.zeros_like(x) if dx is None else dx, False)

    def _add_grads(self, pairs: Any) -> None:
        acc, into, adds = self.result.grads, [], []
        for p, g in pairs:
            if g is None:
                continue
            if id(p) in acc:
                into.append(acc[id(p)])
                adds.append(g)
            else:
                acc[id(p)] = g
        if into:  # one call for the stage's parameters (a loop of add_ cost ~5 us each)
            torch._foreach_add_(into, adds)

    def _send(self, msg: Message, tensor: torch.Tensor, with_header: bool) -> None:
        dst = self.schedule.rank_of(msg.dst_stage)
        if dst == self.position:
            self.stash[msg] = tensor.detach()
            return
        header = None
        if with_header:
            count = self.schedule.micro_batches
            header = Header(msg.micro_batch, count, tensor.dtype, tuple(tensor.shape))
        self.transport.send(dst, msg, tensor, header)
        if dst in self.channels:  # the next receives from dst go out with the send: one burst
            self._expect(dst)
        if self.sent is not None:  # a forward-only pass on one stage per rank (see run)
            self.sent[dst] += 1
            if self.sent[dst] > KEPT_SENDS:
                self.transport.acked(dst, self.sent[dst] - KEPT_SENDS)

    def _take(self, msg: Message, soon: int | None = None) -> torch.Tensor:
        """``msg``, read from its channel in the sender's order (others set aside). The
        receive of the channel's next message is posted now if the next action reads from
        this channel too (``soon``), else after this action: a receive posted late makes a
        message already sent wait for the sender's communication thread to learn of it (a
        thread the stages' compute may starve), and one posted now delays this action."""
        src = self.schedule.rank_of(msg.src_stage)
        if src != self.position:
            channel = self.channels[src]
            start = time.perf_counter()
            while msg not in self.stash:
                nxt = channel[self.read[src]]
                self.read[src] += 1
                self.stash[nxt] = self.transport.receive(src, nxt, self._like(nxt))
            if src == soon:
                self._expect(src)
            self.result.recv_wait_s += time.perf_counter() - start
        return self.stash.pop(msg)

    def _release(self, src: int) -> None:
        """Free the sends ``src`` has acknowledged by the messages read from it so far (run
        after the action that needed the message: nothing waits for it)."""
        acks, read = self.acks.get(src), self.read[src]
        if acks and read and acks[read - 1] > self.freed[src]:
            self.freed[src] = acks[read - 1]
            self.transport.acked(src, acks[read - 1])

    def _expect(self, src: int) -> None:
        """Let the transport receive the next message of each of ``src``'s streams ahead (the
        transport posts each stream's once; ``tables.stream_tag``), those whose shape is known
        or in a header."""
        channel, read = self.channels[src], self.read[src]
        if read >= len(channel):
            return
        for i in self.firsts[src][read]:
            nxt = channel[i]
            like = self._like(nxt)
            if nxt.kind == "act" or like is not None:
                self.transport.expect(src, nxt, like)

    def _like(self, msg: Message) -> torch.Tensor | None:
        """A gradient has the shape of the activation this rank sent; None: read a header."""
        if msg.kind == "act":
            return None
        saved = self.saved.get((msg.dst_stage, msg.micro_batch))
        return None if saved is None else _tensor_output(saved[1], msg.dst_stage)


def _activation(out: Any, stage: int, forward_only: bool) -> torch.Tensor:
    """The tensor stage ``stage`` passes on: gradients flow back through floating point only."""
    out = _tensor_output(out, stage)
    if not forward_only and not out.is_floating_point():
        raise ConfigError(
            f"pipeline stage {stage} passes a {out.dtype} activation to the next stage; "
            "training needs its gradient, which only floating-point tensors have",
            fix="cut the model where the activation is floating point (e.g. after the "
            "embedding, not before it).",
        )
    return out


def _tensor_output(out: Any, stage: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"pipeline stage {stage} returned {type(out).__name__}, not a tensor; stages in "
            "different processes pass one tensor to the next",
            fix="make every layer (block) return one tensor; wrap layers that return tuples in "
            "a module that returns the tensor to pass on.",
        )
    return out
