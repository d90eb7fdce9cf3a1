"""Pipeline schedules as data: for each rank, the ordered list of what it computes.

A schedule never touches a tensor or a process: it is a pure function of the number of ranks
``p``, of micro-batches ``m`` and of virtual stages per rank ``v`` (``Schedule``), so it can be
checked without processes (``simulate.py``: no deadlock, memory, bubble) and one executor runs
every schedule (``execution/executor.py``). The model is cut into ``S = p * v`` stages; stage ``s`` lives
on rank ``s % p`` (with ``v = 2`` and ``p = 4``, rank 1 holds stages 1 and 5).

Actions (``Action(kind, stage, micro_batch)``):

- ``F``: forward of one micro-batch through one stage (the last stage also computes its loss);
- ``B``: its whole backward (input and weight gradients);
- ``I`` and ``W``: the backward split in two, as zero-bubble schedules do: ``I`` computes the
  gradient of the stage's input (what the previous stage waits for), ``W`` the gradients of
  the weights (which nobody waits for, so it fills what would be idle time).

Sends and receives are implied: an ``F`` of stage ``s > 0`` needs the activation of stage
``s - 1``; a ``B``/``I`` of stage ``s < S - 1`` needs the gradient from stage ``s + 1``.

The schedules (Huang et al. 2019; Narayanan et al. 2021; Qi et al. 2023):

- ``gpipe``: every forward, then every backward. Holds ``m`` micro-batches' activations.
- ``1f1b``: ``p - 1 - r`` forwards to fill the pipe, then one forward, one backward. Rank ``r``
  holds at most ``p - r`` micro-batches' activations, whatever ``m``. Same bubble as GPipe.
- ``interleaved_1f1b``: 1F1B over ``v`` virtual stages per rank, micro-batches in rounds of
  ``p``. The bubble shrinks by ``v`` (each virtual stage is ``1/v`` of the work), for ``v``
  times the point-to-point traffic.
- ``zero_bubble``: 1F1B (``v = 1``, ZB-H1) or its interleaved form (``v > 1``) with ``B`` split
  into ``I`` and ``W``; rank ``r`` delays its ``W`` passes by ``r`` backward steps, filling the
  drain at the end of the step. Same peak activation memory as 1F1B (counted over the ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError

Kind = Literal["F", "B", "I", "W"]


@dataclass(frozen=True, order=True)
class Action:
    """One computation of one rank: ``kind`` of micro-batch ``micro_batch`` on ``stage``."""

    kind: Kind
    stage: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.stage}"


@dataclass(frozen=True)
class Message:
    """A tensor one stage sends another: an activation (``"act"``, forward) or a gradient
    (``"grad"``, backward) of one micro-batch, from stage ``src_stage``."""

    kind: Literal["act", "grad"]
    src_stage: int
    micro_batch: int

    @property
    def dst_stage(self) -> int:
        return self.src_stage + 1 if self.kind == "act" else self.src_stage - 1


@dataclass(frozen=True)
class Schedule:
    """A schedule: ``actions[r]`` is what rank ``r`` (its position in the pipeline) runs, in
    order. Stage ``s`` is held by rank ``s % ranks``."""

    name: str
    ranks: int
    micro_batches: int
    stages_per_rank: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    @property
    def split_backward(self) -> bool:
        """True when backward passes are split into ``I`` and ``W`` (zero-bubble)."""
        return any(a.kind == "W" for acts in self.actions for a in acts)

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, first to last."""
        return [rank + k * self.ranks for k in range(self.stages_per_rank)]

    def needs(self, action: Action) -> Message | None:
        """The message ``action`` waits for from another stage, if any."""
        if action.kind == "F" and action.stage > 0:
            return Message("act", action.stage - 1, action.micro_batch)
        if action.kind in ("B", "I") and action.stage < self.num_stages - 1:
            return Message("grad", action.stage + 1, action.micro_batch)
        return None

    def produces(self, action: Action) -> Message | None:
        """The message ``action``'s result is sent as, if any."""
        if action.kind == "F" and action.stage < self.num_stages - 1:
            return Message("act", action.stage, action.micro_batch)
        if action.kind in ("B", "I") and action.stage > 0:
            return Message("grad", action.stage, action.micro_batch)
        return None

    def sends(self, src: int, dst: int) -> list[Message]:
        """Every message rank ``src`` sends rank ``dst`` in one step, in the order it sends
        them: a receiver reads a channel in this order (point-to-point traffic between two
        ranks is first in, first out on every backend)."""
        out = []
        for action in self.actions[src]:
            msg = self.produces(action)
            if msg is not None and self.rank_of(msg.dst_stage) == dst:
                out.append(msg)
        return out

    def acks(self, src: int, dst: int) -> list[int]:
        """For each message of ``sends(src, dst)``: how many of the messages ``dst`` sends
        ``src`` (``sends(dst, src)``) ``src`` has read before sending it. A rank reads a
        channel in order, at the latest when an action needs a message: so a rank that reads
        ``src``'s message knows that many of its own were read (their sends are complete)."""
        index = {m: i for i, m in enumerate(self.sends(dst, src))}
        read, out = 0, []
        for action in self.actions[src]:
            need = self.needs(action)
            if need in index:
                read = max(read, index[need] + 1)
            msg = self.produces(action)
            if msg is not None and self.rank_of(msg.dst_stage) == dst:
                out.append(read)
        return out

    def forward_only(self, rank: int) -> list[Action]:
        """The ``F`` actions of ``rank`` in schedule order: an evaluation forward."""
        return [a for a in self.actions[rank] if a.kind == "F"]


def _check(name: str, ranks: int, micro_batches: int, stages_per_rank: int) -> None:
    for label, value in (("ranks", ranks), ("micro_batches", micro_batches),
                         ("stages_per_rank", stages_per_rank)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"pipeline schedule {name!r}: {label}={value!r} must be an integer >= 1",
                fix="pass whole numbers: ranks (pipeline stages), micro-batches per batch "
                "(microbatches=/chunks=) and stages_per_rank (virtual stages, 1 unless "
                "interleaved).",
            )


def gpipe(ranks: int, micro_batches: int, stages_per_rank: int = 1) -> Schedule:
    """Every forward (micro-batch order), then every backward (the same order)."""
    _check("gpipe", ranks, micro_batches, stages_per_rank)
    rows = []
    for r in range(ranks):
        stages = [r + k * ranks for k in range(stages_per_rank)]
        fwd = [Action("F", s, i) for s in stages for i in range(micro_batches)]
        bwd = [Action("B", s, i) for s in reversed(stages) for i in range(micro_batches)]
        rows.append(tuple(fwd + bwd))
    return Schedule("gpipe", ranks, micro_batches, stages_per_rank, tuple(rows))


def _rounds(ranks: int, micro_batches: int, chunks: int, reverse: bool) -> Iterator[tuple[int, int]]:
    """(chunk, micro_batch) in interleaved order: micro-batches go in rounds of ``ranks``
    (the last round may be shorter); each round runs through chunk 0, 1, ... (forward) or
    the chunks in reverse (backward) before the next round starts."""
    for start in range(0, micro_batches, ranks):
        size = min(ranks, micro_batches - start)
        order = range(chunks - 1, -1, -1) if reverse else range(chunks)
        for chunk in order:
            for i in range(size):
                yield chunk, start + i


def _warmup(rank: int, ranks: int, chunks: int, micro_batches: int) -> int:
    """Forwards before the first backward: 1F1B's ``p - 1 - r`` at one chunk. Interleaved:
    every chunk but the last of the first round, and two forwards per rank below this one
    (torch's and Megatron-LM's count) when ``m`` is a multiple of ``p``. On paper one per rank
    gives the same step time with less memory, but then each steady-state forward waits on a
    message sent just before it: measured, interleaved steps took about 6% longer
    (benchmarks/results/pipeline_warmup_ab_round5.json). Otherwise one per rank: two can
    deadlock there."""
    per_rank = 2 if chunks > 1 and micro_batches % ranks == 0 else 1
    return min((chunks - 1) * ranks + per_rank * (ranks - 1 - rank), micro_batches * chunks)


def _one_f_one_b_rank(
    rank: int, ranks: int, micro_batches: int, chunks: int, zero_bubble: bool
) -> tuple[Action, ...]:
    fwd = [(rank + c * ranks, i) for c, i in _rounds(ranks, micro_batches, chunks, False)]
    bwd = [(rank + c * ranks, i) for c, i in _rounds(ranks, micro_batches, chunks, True)]
    total = len(fwd)
    warm = _warmup(rank, ranks, chunks, micro_batches)
    delay = rank if zero_bubble else None
    out = [Action("F", s, i) for s, i in fwd[:warm]]
    weights_done = 0

    def backward(j: int) -> None:
        nonlocal weights_done
        s, i = bwd[j]
        out.append(Action("I" if zero_bubble else "B", s, i))
        if delay is not None and j >= delay:  # W of the backward `delay` steps earlier
            out.append(Action("W", *bwd[weights_done]))
            weights_done += 1

    for j in range(total - warm):
        out.append(Action("F", *fwd[warm + j]))
        backward(j)
    for j in range(total - warm, total):
        backward(j)
    if zero_bubble:
        out.extend(Action("W", s, i) for s, i in bwd[weights_done:])
    return tuple(out)


def one_f_one_b(ranks: int, micro_batches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B (one virtual stage per rank; ``interleaved_1f1b`` for more)."""
    _check("1f1b", ranks, micro_batches, stages_per_rank)
    if stages_per_rank != 1:
        return interleaved_1f1b(ranks, micro_batches, stages_per_rank)
    rows = tuple(_one_f_one_b_rank(r, ranks, micro_batches, 1, False) for r in range(ranks))
    return Schedule("1f1b", ranks, micro_batches, 1, rows)


def interleaved_1f1b(ranks: int, micro_batches: int, stages_per_rank: int = 2) -> Schedule:
    """1F1B over ``stages_per_rank`` virtual stages per rank (Megatron-LM's interleaving)."""
    _check("interleaved_1f1b", ranks, micro_batches, stages_per_rank)
    rows = tuple(
        _one_f_one_b_rank(r, ranks, micro_batches, stages_per_rank, False) for r in range(ranks)
    )
    return Schedule("interleaved_1f1b", ranks, micro_batches, stages_per_rank, rows)


def zero_bubble(ranks: int, micro_batches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B with split backward passes, ``W`` delayed by the rank (ZB-H1 at one stage per
    rank; interleaved with more)."""
    _check("zero_bubble", ranks, micro_batches, stages_per_rank)
    rows = tuple(
        _one_f_one_b_rank(r, ranks, micro_batches, stages_per_rank, True) for r in range(ranks)
    )
    return Schedule("zero_bubble", ranks, micro_batches, stages_per_rank, rows)


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble,
}
"""Every schedule by name: ``fn(ranks, micro_batches, stages_per_rank) -> Schedule``."""

DEFAULT_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1}
"""``stages_per_rank`` when not given: interleaving needs at least 2."""


def make(name: str, ranks: int, micro_batches: int, stages_per_rank: int | None = None) -> Schedule:
    """The schedule called ``name``; a ``ConfigError`` naming the choices for any other."""
    if name not in SCHEDULES:
        raise ConfigError(
            f"pipeline schedule {name!r} is not one of {', '.join(map(repr, SCHEDULES))}",
            fix="pass schedule='1f1b' (the default: activation memory bounded by the number of "
            "stages), 'gpipe', 'interleaved_1f1b' (smaller bubble, stages_per_rank=2+) or "
            "'zero_bubble'.",
        )
    v = DEFAULT_STAGES_PER_RANK[name] if stages_per_rank is None else stages_per_rank
    if name == "interleaved_1f1b" and v == 1:
        raise ConfigError(
            "schedule='interleaved_1f1b' with stages_per_rank=1 is plain 1F1B",
            fix="pass stages_per_rank=2 (or more) to interleave, or schedule='1f1b'.",
        )
    return SCHEDULES[name](ranks, micro_batches, v)
