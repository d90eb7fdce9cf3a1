"""What makes up one backward pass when autograd splits it, and the errors when it goes wrong.

**Reentrant activation checkpointing** (``checkpoint(..., use_reentrant=True)``) recomputes a
segment and runs a *nested* backward inside the outer one: the segment's gradients arrive in
another autograd graph task, whose end comes before the outer pass is over. The reducer's
end-of-pass callback therefore hands itself on (``finish_in_outer``) until it runs in the
outermost backward, unless every bucket is already out (torch's reducer finishes then too).

**static_graph=True** lets a gradient arrive several times in one pass (a layer checkpointed
twice with ``use_reentrant=True`` is recomputed, and its parameters accumulate, twice).
:class:`ArrivalCounts` learns in the first synchronised pass how often each parameter's hook
fires, and later passes treat a gradient as ready at its last arrival, as torch's static graph
mode does. Without ``static_graph`` a second arrival is refused with torch's reason, and so is
``find_unused_parameters=True`` with gradients from a nested backward (torch's search for
unused parameters cannot see into a reentrant checkpoint, so it refuses; we refuse the same
programs so that code moving between the two engines behaves alike).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd import Variable

from ....errors import ModelError

_MAX_NAMES = 10
"""How many parameter names an error lists before '... and N more'."""

MARKED_TWICE = "Expected to mark a variable ready only once"
"""torch's DistributedDataParallel wording for a gradient that arrives twice (kept verbatim:
code and tests match it)."""


class ArrivalCounts:
    """static_graph: how many times each parameter's gradient arrives in one backward pass."""

    def __init__(self, n: int) -> None:
        self.expected: list[int] | None = None  # None until the first synchronised pass ends
        self.count = [0] * n

    @property
    def learning(self) -> bool:
        return self.expected is None

    def arrive(self, i: int) -> bool:
        """Count one arrival of ``i``'s gradient; True when it is the last expected one (or a
        surplus, which the reducer refuses as arriving twice)."""
        self.count[i] += 1
        return self.expected is not None and self.count[i] >= self.expected[i]

    def end_pass(self, keep: bool) -> None:
        """A synchronised pass ended (``keep``: it completed, so its counts are the graph's)."""
        if keep and self.expected is None:
            self.expected = list(self.count)
        self.count = [0] * len(self.count)


def current_task() -> int:
    """The id of the autograd graph task running this hook (nested backwards have their own)."""
    return torch._C._current_graph_task_id()


def nested() -> bool:
    """Running inside another backward (a reentrant checkpoint's backward, or its recomputed
    forward)."""
    return torch._C._current_autograd_node() is not None


def finish_in_outer(callback: Callable[[], None]) -> bool:
    """Inside a nested backward, arrange for ``callback`` to run at the end of the enclosing one
    and return True; in the outermost backward return False (run it now)."""
    node = torch._C._current_autograd_node()  # the outer node whose backward nests this one
    if node is None:
        return False
    node.register_hook(lambda *_: Variable._execution_engine.queue_callback(callback))
    return True


def names_of(names: Sequence[str], indices: Sequence[int]) -> str:
    shown = ", ".join(names[i] for i in indices[:_MAX_NAMES])
    extra = len(indices) - _MAX_NAMES
    return shown + (f" ... and {extra} more" if extra > 0 else "")


def unused_error(names: Sequence[str], missing: list[int], total: int, rank: int) -> ModelError:
    return ModelError(
        f"{len(missing)} of {total} parameters got no gradient in this backward "
        f"pass: {names_of(names, missing)}. DistributedDataParallel cannot average a gradient "
        "that was never computed, and with find_unused_parameters=False it does not look "
        "for such parameters",
        fix="set find_unused_parameters=True in DistributedDataParallel(...) if these "
        "parameters are unused on purpose (a branch that is skipped, an auxiliary head), or "
        "freeze them with requires_grad_(False) before wrapping if they never train.",
        rank=rank,
    )


def twice_error(name: str, rank: int) -> ModelError:
    return ModelError(
        f"{MARKED_TWICE}: parameter {name} received its gradient twice in one backward pass "
        "(a layer checkpointed more than once with use_reentrant=True, a parameter used in "
        "several reentrant backward passes, or a nested backward through the model)",
        fix="use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or pass "
        "static_graph=True if the model runs the same layers in every iteration.",
        rank=rank,
    )


def reentrant_unused_error(name: str, rank: int) -> ModelError:
    return ModelError(
        f"{MARKED_TWICE}: parameter {name}'s gradient came from a nested (reentrant) backward "
        "pass while find_unused_parameters=True; torch's DistributedDataParallel refuses "
        "this combination, its search for unused parameters cannot see inside a reentrant "
        "checkpoint",
        fix="use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or pass "
        "static_graph=True (then find_unused_parameters is not needed).",
        rank=rank,
    )
