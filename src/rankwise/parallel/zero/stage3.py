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

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from .engine_view import ShardedEngine


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


class Stage3Hooks:
    """Forward/backward hooks of every stage-3 unit; ``modules[u]`` is unit ``u``'s module.

    A module may own several units (one per optimizer parameter group): its hooks gather and
    free them together, as one *segment*.
    """

    def __init__(self, engine: ShardedEngine, modules: list[nn.Module | None]) -> None:
        self.engine = engine
        self.units = engine.units
        root = engine._root
        self.roots = [u for u, mod in enumerate(modules) if mod is root]
        by_module: dict[int, tuple[nn.Module, list[int]]] = {}
        for u, mod in enumerate(modules):
            if mod is not None and mod is not root:
                by_module.setdefault(id(mod), (mod, []))[1].append(u)
        self.segments = [units for _, units in by_module.values()]
        self.order: list[int] = []
        """Segments in the order the first forward pass gathered them (drives prefetching)."""
        self.position: dict[int, int] = {}
        self.recording = True
        # The hooks change storage sizes (gather, free): under torch.compile they run eagerly,
        # between graphs, instead of being traced into one.
        pre, post = torch.compiler.disable(self._pre_forward), torch.compiler.disable(self._post_forward)
        for s, (mod, _) in enumerate(by_module.values()):
            mod.register_forward_pre_hook(functools.partial(pre, s))
            mod.register_forward_hook(functools.partial(post, s))
        # The root's hooks too, so that the user's own methods calling the model (generate,
        # called through the engine or on the bare module) gather the root's units.
        root.register_forward_pre_hook(torch.compiler.disable(self._root_pre))
        root.register_forward_hook(torch.compiler.disable(self._root_post))
        root.register_state_dict_post_hook(functools.partial(Stage3Hooks._full_state, self))
        self.free_all()

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        self._gather(self.roots)

    def _root_post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.recording and not self.engine._full:
            self.recording = False
            self.position = {s: i for i, s in reversed(list(enumerate(self.order)))}
        if not (torch.is_grad_enabled() and _grad_outputs(out)):
            self.free_all()  # no backward will follow (evaluation, generate)

    def _full_state(self, module: nn.Module, state: dict, prefix: str, metadata: Any) -> None:
        """The root's ``state_dict()`` holds full values on every rank, as one process's:
        each unit gathered in turn, its parameters copied (a tied one copied once, so its
        keys still share a tensor), freed again. Sync point: all ranks."""
        keys: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if prefix + name in state:
                keys.setdefault(id(p), []).append(prefix + name)
        for u, unit in enumerate(self.units):
            mine = [p for p in unit.params if id(p) in keys]
            if not mine:
                continue
            was = unit.gathered
            self._gather([u])
            for p in mine:
                copy = p.detach().clone()
                for key in keys[id(p)]:
                    state[key] = copy
            if not was:
                unit.free()

    def _gather(self, units: list[int]) -> None:
        for u in units:
            self.units[u].gather()
        for u in units:
            self.units[u].wait_gathered()

    def _free(self, units: list[int]) -> None:
        # Kept while every parameter is summoned (full_parameters), and while a backward pass
        # is under way: a forward then is an activation checkpoint's recomputation, whose
        # results backward reads next (the unit is freed when its gradients are in).
        if not (self.engine._full or self.engine._active):
            for u in units:
                self.units[u].free()

    def _prefetch(self, s: int, step: int) -> None:
        i = self.position.get(s)
        if i is not None and 0 <= i + step < len(self.order):
            for u in self.segments[self.order[i + step]]:
                self.units[u].gather()

    def _pre_forward(self, s: int, module: nn.Module, args: Any) -> None:
        self._gather(self.segments[s])
        if self.recording and not self.engine._full:
            self.order.append(s)
        elif not self.recording:
            self._prefetch(s, +1)

    def _post_forward(self, s: int, module: nn.Module, args: Any, out: Any) -> None:
        tensors = _grad_outputs(out) if torch.is_grad_enabled() else []
        if tensors and not self.engine._full:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward, s), mode="any"
            )
        self._free(self.segments[s])

    def _pre_backward(self, s: int, grad: Any) -> None:
        if not self.engine._active:
            self.engine._begin()
        self._gather(self.segments[s])
        self._prefetch(s, -1)

    def backward_done(self, u: int) -> None:
        """All of unit ``u``'s gradients are in: its full parameters can go."""
        if u not in self.roots and not self.engine._full:
            self.units[u].free()

    @contextlib.contextmanager
    def summon(self, writeback: bool) -> Iterator[None]:
        """Every unit gathered for the block (``full_parameters``); with ``writeback`` the
        values are copied back into this rank's shards on exit. Sync point: all ranks."""
        engine = self.engine
        self._gather(list(range(len(self.units))))
        engine._full = True
        try:
            yield
        finally:
            engine._full = False
            if writeback:
                with torch.no_grad():
                    for unit in self.units:
                        unit.shard.copy_(unit.full[unit.lo : unit.hi])
            self.free_all()

    def free_all(self) -> None:
        if self.engine._full:
            return
        for unit in self.units:
            unit.free()
