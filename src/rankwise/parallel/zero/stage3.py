"""Stage 3's module hooks: gather a unit's parameters before it computes, free them after.

Forward: a unit's pre-forward hook gathers it (waiting for a prefetch already under way) and
starts the gathers of the modules predicted to run next (``prefetch``: the order of the last
pass); its forward hook frees it and, when the output needs gradients, registers a hook that
fires as soon as the first gradient of that output is computed — i.e. just before the unit's
backward — to gather it again and prefetch the modules backward reaches next. The engine frees
a unit once all of its parameters have their gradients, and frees everything at the end of the
backward pass.

Prefetch depth N (``ShardedDataParallel(prefetch=N)``, 0: off) bounds memory: at most N modules
are gathered ahead of the ones computing, and a prefetch is started only while fewer than N+1
unit modules (the root's units aside) are gathered. Gathers on demand (a module that runs) are
never held back, so nested units, or a checkpoint recomputing several modules at once, can hold
more; the count is ``stats["peak_gathered"]``. Prefetching changes when a gather starts, never
what it gathers nor any reduction: results are bitwise those of prefetch off.

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

from .prefetch import Lookahead, Orders

if TYPE_CHECKING:
    from .engine_view import ShardedEngine


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


class Stage3Hooks:
    """Forward/backward hooks of every stage-3 unit; ``modules[u]`` is unit ``u``'s module.

    A module may own several units (one per optimizer parameter group): its hooks gather and
    free them together, as one *segment*.
    """

    def __init__(
        self, engine: ShardedEngine, modules: list[nn.Module | None], depth: int = 1
    ) -> None:
        self.engine = engine
        self.units = engine.units
        root = engine._root
        self.roots = [u for u, mod in enumerate(modules) if mod is root]
        by_module: dict[int, tuple[nn.Module, list[int]]] = {}
        for u, mod in enumerate(modules):
            if mod is not None and mod is not root:
                by_module.setdefault(id(mod), (mod, []))[1].append(u)
        self.segments = [units for _, units in by_module.values()]
        self.depth = depth
        """Prefetch depth N: segments gathered ahead of the ones computing (0: off)."""
        self.orders = Orders()
        self._fwd: Lookahead | None = None
        self._bwd: Lookahead | None = None
        self._ahead: set[int] = set()
        """Segments prefetched whose module has not started yet."""
        self.stats = {"peak_gathered": 0, "prefetched": 0, "hits": 0, "misses": 0}
        """Counters for tests and benchmarks: the most unit modules gathered at once (the
        root's units aside), prefetches started, predictions met and missed."""
        # The hooks change storage sizes (gather, free): under torch.compile they run eagerly,
        # between graphs, instead of being traced into one.
        pre, post = torch.compiler.disable(self._pre_forward), torch.compiler.disable(self._post_forward)
        self.node = self.units[0].node if self.units else None
        """Stage 3 on one machine (``comm/node_shared``): every unit is always whole, in
        shared memory; the modules need no hooks, only barriers between writes and reads."""
        for s, (mod, _) in enumerate(by_module.values() if self.node is None else ()):
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
        self._drop_ahead(())  # a pass that raised, or a nested call: its guesses are stale
        engine = self.engine
        # A recomputation during backward, or a full_parameters block, predicts nothing.
        busy = engine._full or engine._active
        if self.node is not None and not busy:
            self.node.before_read()  # what a step or a load wrote is written on every rank
        self._fwd = None if busy else self.orders.start_forward(torch.is_grad_enabled())
        if not busy:
            self._bwd = None  # a backward pass that died half-way predicts nothing now

    def _root_post(self, module: nn.Module, args: Any, out: Any) -> None:
        backward = torch.is_grad_enabled() and bool(_grad_outputs(out))
        if self._fwd is not None:
            look, self._fwd = self._fwd, None
            self._count(look)
            self.orders.end_forward(look, torch.is_grad_enabled(), backward)
            self._drop_ahead(())
        if not backward:
            self.free_all()  # no backward will follow (evaluation, generate)

    def _full_state(self, module: nn.Module, state: dict, prefix: str, metadata: Any) -> None:
        """The root's ``state_dict()`` holds full values on every rank, as one process's:
        each unit gathered in turn, its parameters copied (a tied one copied once, so its
        keys still share a tensor), freed again. Sync point: all ranks."""
        if self.node is not None and not self.engine._full:
            self.node.before_read()  # a state right after a step: every rank's update is in
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

    # -- prefetch ---------------------------------------------------------------------------

    def _held(self) -> int:
        return sum(1 for seg in self.segments if any(self.units[u].gathered for u in seg))

    def _note_peak(self) -> None:
        self.stats["peak_gathered"] = max(self.stats["peak_gathered"], self._held())

    def _count(self, look: Lookahead) -> None:
        self.stats["hits"] += look.hits
        self.stats["misses"] += look.misses

    def _start(self, s: int, look: Lookahead | None) -> None:
        """Segment ``s`` starts computing: its gather issued (if not already), the pass's next
        ones prefetched, then its own gather waited for, so they overlap."""
        self._ahead.discard(s)
        for u in self.segments[s]:
            self.units[u].gather()
        self._note_peak()
        if look is not None:
            look.arrive(s)
            self._drop_ahead(look.ahead(self.depth))
            self._top_up(look)
        for u in self.segments[s]:
            self.units[u].wait_gathered()

    def _top_up(self, look: Lookahead | None) -> None:
        """Start the gathers of the next predicted segments, while fewer than depth+1 unit
        modules are gathered (the memory bound)."""
        if look is None or not self.depth or self.engine._full:
            return
        for s in look.ahead(self.depth):
            units = self.segments[s]
            if any(self.units[u].gathered for u in units):
                continue  # computing, or already prefetched
            if self._held() > self.depth:
                return
            for u in units:
                self.units[u].gather()
            self._ahead.add(s)
            self.stats["prefetched"] += 1
            self._note_peak()

    def _drop_ahead(self, keep: Any) -> None:
        """Free prefetched segments no longer predicted (a miss): never one that computes."""
        if self.engine._full:
            return
        for s in [s for s in self._ahead if s not in keep]:
            self._ahead.discard(s)
            for u in self.segments[s]:
                self.units[u].free()

    # -- the hooks ----------------------------------------------------------------------------

    def _pre_forward(self, s: int, module: nn.Module, args: Any) -> None:
        # During backward a forward is an activation checkpoint's recomputation: on demand.
        self._start(s, None if self.engine._active else self._fwd)

    def _post_forward(self, s: int, module: nn.Module, args: Any, out: Any) -> None:
        tensors = _grad_outputs(out) if torch.is_grad_enabled() else []
        if tensors and not self.engine._full:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._pre_backward, s), mode="any"
            )
        self._free(self.segments[s])
        if not self.engine._active:
            self._top_up(self._fwd)

    def _pre_backward(self, s: int, grad: Any) -> None:
        if not self.engine._active:
            self.engine._begin()
        if self._bwd is None:
            self._bwd = self.orders.start_backward()
        self._start(s, self._bwd)

    def backward_done(self, u: int) -> None:
        """All of unit ``u``'s gradients are in: its full parameters can go."""
        if u not in self.roots and not self.engine._full:
            self.units[u].free()
            self._top_up(self._bwd)

    def end_backward(self) -> None:
        """The engine's backward pass is over: everything freed, the next one predicted anew."""
        if self._bwd is not None:
            self._count(self._bwd)
            self._bwd = None
        self.orders.end_backward()
        self.free_all()

    @contextlib.contextmanager
    def summon(self, writeback: bool) -> Iterator[None]:
        """Every unit gathered for the block (``full_parameters``); with ``writeback`` the
        values are copied back into this rank's shards on exit. Sync point: all ranks."""
        engine = self.engine
        self._gather(list(range(len(self.units))))
        if self.node is not None:
            self.node.before_read()  # the shared units: every rank's latest update is in
        engine._full = True
        try:
            yield
        finally:
            engine._full = False
            if writeback and self.node is None:  # shared units were written in place
                with torch.no_grad():
                    for unit in self.units:
                        unit.shard.copy_(unit.full[unit.lo : unit.hi])
            self.free_all()

    def free_all(self) -> None:
        if self.engine._full:
            return
        self._ahead.clear()
        for unit in self.units:
            unit.free()
