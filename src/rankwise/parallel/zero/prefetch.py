"""Stage 3's prefetch predictor: which unit modules a pass will gather next.

A pass (one forward, or one backward) runs the unit modules in some order. The forward order
is recorded every pass, per grad mode (a training forward and an evaluation or ``generate``
forward may differ), and the next pass of that mode predicts the same order; the backward pass
predicts the reverse of the forward passes run since the last backward (the order autograd
meets the modules' outputs). A pass whose order changed records the new one.

``Lookahead`` follows one pass: each module that starts is checked against the prediction. A
hit moves on; a module found later in the prediction skips to it; a module the prediction does
not hold ends prediction for the pass (the hooks then gather on demand, as with prefetch off).
The hooks free a prefetched module that fell out of the window, so a wrong guess costs one
gather, never memory beyond the bound.

Pure: nothing here communicates; the decisions depend only on the order modules run in, which
is the same on every rank, so every rank issues the same gathers in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

_KEPT = 1 << 14
"""Segment starts kept for the backward prediction (gradient accumulation over many forwards
before one backward keeps the latest)."""


class Lookahead:
    """One pass against its predicted order of segments (unit modules, by index)."""

    def __init__(self, predicted: Sequence[int]) -> None:
        self.predicted = list(predicted)
        self.seen: list[int] = []
        """Segments in the order they started in this pass (the next pass's prediction)."""
        self._next = 0
        self.lost = not self.predicted
        self.hits = self.misses = 0

    def arrive(self, segment: int) -> bool:
        """``segment`` starts; True when it is the one predicted next."""
        self.seen.append(segment)
        if self.lost:
            return False
        pred, k = self.predicted, self._next
        if k < len(pred) and pred[k] == segment:
            self._next += 1
            self.hits += 1
            return True
        self.misses += 1
        try:  # a module skipped (not run this time): pick up the prediction after it
            self._next = pred.index(segment, k + 1) + 1
        except ValueError:
            self.lost = True
        return False

    def ahead(self, depth: int) -> list[int]:
        """The ``depth`` segments predicted to start next (none once the prediction is lost)."""
        if self.lost:
            return []
        return self.predicted[self._next : self._next + depth]


class Orders:
    """The recorded forward orders (one per grad mode) and the forward passes since the last
    backward, from which a pass's ``Lookahead`` is built."""

    def __init__(self) -> None:
        self.forward: dict[bool, list[int]] = {}
        self.since_backward: list[int] = []
        self.rerecorded = 0
        """How many passes ran in an order other than the recorded one (and replaced it)."""

    def start_forward(self, grad: bool) -> Lookahead:
        return Lookahead(self.forward.get(grad, []))

    def end_forward(self, look: Lookahead, grad: bool, backward_follows: bool) -> None:
        old = self.forward.get(grad)
        if old != look.seen:
            if old is not None:
                self.rerecorded += 1
            self.forward[grad] = list(look.seen)
        if backward_follows:  # forwards whose backward never ran do not grow it forever
            self.since_backward = (self.since_backward + look.seen)[-_KEPT:]

    def start_backward(self) -> Lookahead:
        return Lookahead(self.since_backward[::-1])

    def end_backward(self) -> None:
        self.since_backward = []
