"""``ShardedDataParallel``: data parallelism where each rank keeps 1/N of the training state.

ZeRO's three stages, on plain ``torch.distributed`` collectives:

- **stage 1**: the optimizer state is sharded. Gradients are all-reduced during backward (in
  buckets, like our DDP); each rank's optimizer updates only its slice of the parameters, then
  the slices are all-gathered.
- **stage 2**: the gradients are sharded too. Each bucket is reduce-scattered as soon as its
  gradients are complete, and the full gradient is dropped: a rank keeps only its slice.
- **stage 3**: the parameters are sharded too. A module's parameters are all-gathered just
  before its forward and again before its backward, and freed after each; the next module's
  gather is started early (prefetch) so it overlaps with compute.

The layout (which parameters share a flat buffer, who owns which slice) is ``layout.py``; one
buffer's tensors and collectives are ``shard_unit.py``; the optimizer wrapper and the
world-size-independent state dicts are ``sharded_optim.py``. This module wires them to autograd
with the same hook pattern as the DDP reducer.

Sync point: all ranks, at construction, in every synchronised backward pass, in every
``optimizer.step()``, and (stage 3) in every forward and backward of a sharded module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from ... import validate
from ...errors import ConfigError
from ...timing import clock as timing
from .. import deferred
from ..agreement import (
    broadcast_tensors,
    check_unfrozen,
    frozen_at_wrap,
    trainable_parameters,
    verify_same_model,
)
from ..buckets import DEFAULT_BUCKET_CAP_MB
from ..ddp.devices import group_size_and_rank
from ..ddp.no_sync import gradient_sync_off
from ..ddp.reduction.sparse import refuse_sparse
from . import build, sharded_optim
from .arguments import check_arguments
from .comm.grad_norm import clip_shards_
from .engine_view import OptimizerFactory
from .stage3 import Stage3Hooks, _grad_outputs
from .wrap import WrapPolicy

_IN_FLIGHT = {"cpu": 0}
"""Stages 2/3: gradient reductions (each with its unit's full-size gradient buffer) left in
flight while the next unit's gradients are computed, by device type (others: 1). On a GPU a
reduction runs beside the backward's kernels, as FSDP2's reduce-scatter on its own stream. On
the CPU the backward and Gloo share the cores: each reduction is waited for at once, as FSDP2's
is there, one unit's full gradient less at the backward's peak
(benchmarks/results/zero3_backward_memory_inflight0.json) for about 2.5% of a GPT-2 zero3 step
(1140 against 1112 ms); two in flight cost a unit more and gained no time (1096 against 1031).
Stage 3 through shared memory (``comm/node_shared``) waits for none: its two gradient slots
bound the memory, and a rank waits only to reuse one (``GradSlots._take``)."""

DEFAULT_PREFETCH = 1
"""Stage 3: unit modules gathered ahead of the one computing (docs/zero.md, "Prefetch")."""

DEFAULT_UNIT_NUMEL = 1 << 20
"""Stage 3: a module becomes its own gather unit from this many parameter elements (1M)."""


class ShardedDataParallel(nn.Module):
    """Wrap ``module`` (already on its device) and build its sharded optimizer.

    ``optimizer`` is either a torch optimizer built over ``module``'s parameters as usual (any
    number of parameter groups, each with its own hyperparameters), or a factory that receives
    the list of this rank's flat parameter shards, e.g. ``lambda ps: torch.optim.AdamW(ps,
    lr=1e-3)`` (one group). Given an optimizer, the engine keeps one shard set per group and
    points that same optimizer object at them: it is the one that steps, so learning-rate
    schedulers built on it and ``for g in opt.param_groups: g["lr"] = ...`` keep working.
    ``self.optimizer`` wraps it (use it for ``step``/``zero_grad``/checkpoints). Any optimizer
    whose update is per element works (SGD, Adam, AdamW, RMSprop, ...); those whose update
    needs a parameter's shape or the whole model (LBFGS, Adafactor, Muon) are refused.
    ``stage`` is 1, 2 or 3 (see the module docstring). Stage 3: ``wrap`` chooses the modules
    gathered as one unit (``wrap.py``: by default each repeated block of a ``ModuleList``, e.g.
    a transformer layer), ``unit_numel`` the size from which any other module is its own unit.

    A ``module`` built under ``with torch.device("meta"):`` is initialised here, module by
    module, each rank keeping only its part (``parallel/deferred``): by ``init(module)`` or
    each module's ``reset_parameters()``; ``exact_init`` reproduces an eager CPU build at the
    same seed; ``device``: where it is built (default the CPU). The user's own methods and
    public attributes (``generate``, ``config``, ``save_pretrained``) are reachable on the
    engine: they run on the wrapped module, whose hooks gather what they need.
    ``hierarchical_reduce``: node-first collectives across nodes (``hier_comm``); None whenever
    the job spans nodes, False never, True insists. ``shared_memory``, likewise, on one machine:
    stage 1's all-reduce (``comm/shared``), stage 3's units (``comm/node_shared``).
    ``prefetch``: stage 3 starts the gathers of this many unit modules ahead of the one
    computing, in the order the last pass ran them (0: gather each on demand); at most
    ``prefetch + 1`` unit modules are then gathered at once besides the root's. The
    ``prefetch`` attribute may be changed between steps (``model.prefetch = 0``).

    After a synchronised backward the averaged gradient lives in the optimizer's shards, not in
    the model parameters' ``.grad`` (stage 1 keeps the full ``.grad`` as well); clip with
    :meth:`clip_grad_norm_`, which computes the global norm over all shards.
    """

    _full = False
    """True inside ``full_parameters()``: stage 3 keeps every unit gathered."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        stage: int = 2,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        unit_numel: int = DEFAULT_UNIT_NUMEL,
        broadcast_buffers: bool = True,
        wrap: WrapPolicy = None,
        init: deferred.Init | None = None,
        exact_init: bool = False,
        device: torch.device | str | None = None,
        hierarchical_reduce: bool | None = None,
        shared_memory: bool | None = None,
        prefetch: int = DEFAULT_PREFETCH,
    ) -> None:
        super().__init__()
        check_arguments(module, optimizer, stage, process_group=process_group, wrap=wrap,
                        bucket_cap_mb=bucket_cap_mb, unit_numel=unit_numel, prefetch=prefetch,
                        shared_memory=shared_memory, hierarchical_reduce=hierarchical_reduce)  # fmt: skip
        self.module, self.stage, self.process_group = module, stage, process_group
        self.world_size, self.rank = group_size_and_rank(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.hierarchical_reduce, self.shared_memory = hierarchical_reduce, shared_memory  # build
        self.require_backward_grad_sync = True
        self._forward_sync = True
        refuse_sparse(module, self.rank, "ShardedDataParallel (ZeRO)")
        how = deferred.plan(module, init, exact_init)
        target = torch.device(device if device is not None else "cpu")
        if self.world_size > 1:
            verify_same_model(module, process_group, self.rank)
        self.names, self.params = trainable_parameters(module, self.rank)
        self._frozen_at_wrap = frozen_at_wrap(module, self.params)  # no shard: forward refuses
        build.check_one_dtype(self.names, self.params, self.rank)
        self.group_params, group_of = sharded_optim.optimizer_groups(self, optimizer)
        build.build_units(self, bucket_cap_mb, unit_numel, wrap, group_of, target, how is None)
        build.fill(self, how, target)  # values in the shards (stage 3: on one machine, shared)
        self.optimizer = sharded_optim.ShardedOptimizer(self, optimizer)
        hook = self._make_hook
        self._handles = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(self.params)]
        self._prefetch = prefetch
        kind = self.params[0].device.type if self.params else target.type
        self._in_flight = 1 << 30 if self._shared else _IN_FLIGHT.get(kind, 1)  # _IN_FLIGHT
        self.stage3 = Stage3Hooks(self, self._unit_modules, prefetch) if stage == 3 else None
        self._reset()

    # -- the backward pass --------------------------------------------------------------------

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        u, k = self._where[i]
        unit = self.units[u]
        scale = 1.0 / self.world_size
        keep_full_grad = self.stage == 1

        def hook(p: torch.Tensor) -> None:
            if not self._active:
                self._begin()
            if self._seen[i]:
                self._fired_twice(i)
            self._seen[i] = True
            if self._syncing:
                slot = unit.grad_slot(k)
                if p.grad is slot:
                    slot.mul_(scale)
                else:  # copy and average in one pass
                    torch.mul(p.grad, scale, out=slot)
                p.grad = slot if keep_full_grad else None
            self._pending[u] -= 1
            if self._pending[u] == 0:
                self._unit_done(u)

        return hook

    def _begin(self) -> None:
        self._active = True
        self._syncing = bool(self.require_backward_grad_sync and self._forward_sync)
        Variable._execution_engine.queue_callback(self._finalize)

    def _unit_done(self, u: int) -> None:
        if self.stage3 is not None:
            self.stage3.backward_done(u)
        if self._syncing:
            self._launch_ready()

    def _launch_ready(self) -> None:
        order, pending = self._order, self._pending
        while self._next < len(order) and pending[order[self._next]] == 0:
            self.units[order[self._next]].launch_reduce()
            self._next += 1
            # Stages 2/3 keep at most _in_flight full gradient buffers besides the one being
            # filled: finishing an earlier reduction drops its buffer, so the full gradient
            # never exists all at once.
            while self.stage > 1 and self._next - self._done > self._in_flight:
                self.units[order[self._done]].finish_reduce()
                self._done += 1

    def _finalize(self) -> None:
        """End of backward: fill parameters that got no gradient, wait for every reduction."""
        try:
            if self._syncing:
                self._fill_unused()
                fence = self._shared.fence() if self._shared is not None else None  # comm/shared
                for u in self._order[self._done :]:
                    self.units[u].finish_reduce()
                if fence is not None:
                    fence.wait()
        finally:
            if self.stage3 is not None:
                self.stage3.end_backward()
            self._reset()

    def _fill_unused(self) -> None:
        # A parameter that took no part in this pass contributes what it has (an accumulated
        # .grad from no_sync passes, else zeros), so every rank still sends every unit.
        scale = 1.0 / self.world_size
        for i, seen in enumerate(self._seen):
            if seen:
                continue
            u, k = self._where[i]
            p, slot = self.params[i], self.units[u].grad_slot(k)
            if p.grad is None:
                slot.zero_()
            elif p.grad is slot:
                slot.mul_(scale)
            else:
                torch.mul(p.grad, scale, out=slot)
            p.grad = slot if self.stage == 1 else None
            self._pending[u] = 0
        self._launch_ready()

    def _reset(self) -> None:
        self._active = False
        self._syncing = False
        self._seen = [False] * len(self.params)
        self._pending = [len(u.spec.indices) for u in self.units]
        self._next = 0
        self._done = 0

    # -- forward, no_sync, step ---------------------------------------------------------------

    @property
    def prefetch(self) -> int:
        """Stage 3's prefetch depth (see the class text); settable between steps."""
        return self._prefetch

    @prefetch.setter
    def prefetch(self, depth: int) -> None:
        where = "ShardedDataParallel.prefetch"
        validate.integer("prefetch", depth, minimum=0, where=where, example=1)
        self._prefetch = depth
        if self.stage3 is not None:
            self.stage3.depth = depth

    @property
    def _root(self) -> nn.Module:
        """The wrapped module, for the engine itself (``module`` checks stage 3's sharding)."""
        return self._modules["module"]

    @property
    def module(self) -> nn.Module:
        """The wrapped module. Under stage 3 its parameters are sharded (each rank holds 1/N;
        the module's own tensors are empty between its forward and backward), so reading it
        is refused outside ``full_parameters()``."""
        if self.stage == 3 and not self._full:
            raise ConfigError(
                "model.module of a stage-3 (zero3) model: its parameters are sharded over the "
                "ranks, so the bare module's own tensors are empty outside its forward and "
                "backward",
                fix="call the model's own methods on the model itself (model.generate(...), "
                "model.config, model.save_pretrained(...) gather what they use), or gather "
                "every unit for a block: `with rt.full_parameters(model): model.module...` "
                "(Sync point: all ranks); model.state_dict() is the full state.",
                rank=self.rank,
            )
        return self._root

    def __getattr__(self, name: str) -> Any:
        # The user's own methods and public attributes (model.generate, model.config,
        # save_pretrained), as FSDP2's fully_shard keeps them: they run on the wrapped module,
        # whose stage-3 hooks gather each unit as it computes. Private names stay ours.
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if name.startswith("_") or inner is None:
                raise
            return getattr(inner, name)

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = True) -> Iterator[nn.Module]:
        """Every parameter gathered for the block (stage 3; stages 1/2 always hold them):
        yields the bare module, on which ``generate()``/evaluation run as on one process.

        As FSDP's ``summon_full_params``: for inference and inspection, not training steps.
        With ``writeback``, changes made to the parameters inside are kept (each rank keeps
        its slice). Sync point: all ranks (stage 3 gathers every unit at entry).
        """
        if self.stage < 3 or self._full:
            yield self._root
            return
        with self.stage3.summon(writeback):
            yield self._root

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module (stage 3: gathering each unit's parameters on the way)."""
        if self._active:  # a backward pass died half-way: forget it
            self._reset()
        if self._frozen_at_wrap:
            check_unfrozen(self._frozen_at_wrap, "ShardedDataParallel", self.rank)
        grad_on = torch.is_grad_enabled()
        if grad_on:
            self._forward_sync = self.require_backward_grad_sync
        if self.broadcast_buffers and self.world_size > 1 and grad_on:
            buffers = [b for b in self._root.buffers()]
            if buffers and self.require_backward_grad_sync:
                with torch.no_grad():
                    broadcast_tensors(buffers, self.process_group)
        out = self._root(*inputs, **kwargs)  # stage 3: the root's hooks gather, then free
        if grad_on:
            tensors = _grad_outputs(out)
            if tensors:
                # The backward pass begins on this process's outermost graph task: a reentrant
                # activation checkpoint runs a nested backward whose end is not the pass's.
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._backward_starts, mode="any"
                )
        return out

    def _backward_starts(self, grad: Any) -> None:
        if not self._active:
            self._begin()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (full size); the next backward outside reduces them."""
        return gradient_sync_off(self)

    def _after_step(self) -> None:
        """Stages 1/2: every rank's updated slice to every rank. Sync point: all ranks."""
        if self.stage == 3:
            return
        entries = [unit.all_gather_updated() for unit in self.units]
        with timing.span("blocked"):
            for entry in entries:
                if entry is not None:
                    entry.wait()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the sharded gradients so their global norm is at most ``max_norm``.

        Returns the total norm over all ranks' shards, the same on every rank (what
        ``torch.nn.utils.clip_grad_norm_`` returns on one process). Sync point: all ranks.
        """
        return clip_shards_(self.units, max_norm, norm_type, self.process_group, self._root)

    # -- state: consolidated, independent of the world size and the stage --------------------

    collective_state_dict = True
    """``state_dict()`` is a collective here: ``save_checkpoint`` calls it on every rank."""

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", **kwargs: Any
    ) -> dict[str, Any]:
        """The bare module's full state (no prefix), as one process would have it.

        Called by a parent module (``torch.compile(model)`` after ``rt.prepare``: the compiled
        wrapper's state dict), the keys go into its ``destination`` under its ``prefix``.
        Sync point: all ranks (stage 3 gathers the parameters).
        """
        state = sharded_optim.full_model_state(self)
        if destination is None:
            return state
        for key, value in state.items():
            destination[prefix + key] = value
        return destination

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full (consolidated, DDP or plain) model state into the shards."""
        return sharded_optim.load_full_model_state(self, state_dict, strict)

    def _fired_twice(self, i: int) -> None:
        self._reset()
        raise ConfigError(
            f"parameter {self.names[i]} received its gradient twice in one backward pass "
            "(reentrant activation checkpointing, or a nested backward through the model)",
            fix="use torch.utils.checkpoint.checkpoint(..., use_reentrant=False).",
            rank=self.rank,
        )
