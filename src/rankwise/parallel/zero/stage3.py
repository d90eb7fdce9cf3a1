"""Stage 3's module hooks: gather a unit's parameters before it computes, free them after.

Forward: a unit's pre-forward hook gathers it (waiting for a prefetch already under way) and
starts the gather of the unit that ran next in the first forward pass; its forward hook frees
it and, when the output needs gradients, registers a hook that fires as soon as the first
gradient of that output is computed — i.e. just before the unit's backward — to gather it again
and prefetch the unit that backward reaches next. The engine frees a unit once all of its
parameters have their gradients, and frees everything at the end of the backward pass.

The root module's own parameters (and tied parameters, which two units use) stay gathered from
the start of the forward pass to the end of backward.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from .engine_view import ShardedEngine


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


class Stage3Hooks:
    """Forward/backward hooks of every stage-3 unit; ``modules[u]`` is unit ``u``'s module."""

    def __init__(self, engine: ShardedEngine, modules: list[nn.Module | None]) -> None:
        self.engine = engine
        self.units = engine.units
        last = len(modules) - 1
        self.root = last if modules and modules[last] is engine.module else None
        self.order: list[int] = []
        """Units in the order the first forward pass gathered them (drives prefetching)."""
        self.position: dict[int, int] = {}
        self.recording = True
        for u, mod in enumerate(modules):
            if u == self.root or mod is None:
                continue
            mod.register_forward_pre_hook(functools.partial(self._pre_forward, u))
            mod.register_forward_hook(functools.partial(self._post_forward, u))
        self.free_all()

    def run_root(self, module: nn.Module, inputs: tuple, kwargs: dict) -> Any:
        if self.root is not None:
            self._gather(self.root)
        out = module(*inputs, **kwargs)
        if self.recording:
            self.recording = False
            self.position = {u: i for i, u in reversed(list(enumerate(self.order)))}
        if not (torch.is_grad_enabled() and _grad_outputs(out)):
            self.free_all()  # no backward will follow (evaluation)
        return out

    def _gather(self, u: int) -> None:
        unit = self.units[u]
        unit.gather()
        unit.wait_gathered()

    def _prefetch(self, u: int, step: int) -> None:
        i = self.position.get(u)
        if i is not None and 0 <= i + step < len(self.order):
            self.units[self.order[i + step]].gather()

    def _pre_forward(self, u: int, module: nn.Module, args: Any) -> None:
        self._gather(u)
        if self.recording:
            self.order.append(u)
        else:
            self._prefetch(u, +1)

    def _post_forward(self, u: int, module: nn.Module, args: Any, out: Any) -> None:
        tensors = _grad_outputs(out) if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward, u), mode="any"
            )
        self.units[u].free()

    def _pre_backward(self, u: int, grad: torch.Tensor) -> None:
        if not self.engine._active:
            self.engine._begin()
        self._gather(u)
        self._prefetch(u, -1)

    def backward_done(self, u: int) -> None:
        """All of unit ``u``'s gradients are in: its full parameters can go."""
        if u != self.root:
            self.units[u].free()

    def free_all(self) -> None:
        for unit in self.units:
            unit.free()
