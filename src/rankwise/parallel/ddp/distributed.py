"""``DistributedDataParallel``: one process per device, gradients averaged during backward.

Construction checks, then agrees, then listens:

1. **Check** the module is where it will compute (docs/pitfalls.md#pitfall-1 becomes a message that
   says what to move where) and that there is a process group when the job has several ranks.
2. **Agree**: compare parameter names, shapes and dtypes across ranks (a mismatch names the
   first differing parameter and both ranks), then broadcast rank 0's parameters and buffers,
   once. From then on replicas stay identical because they apply identical averaged gradients.
3. **Listen**: a :class:`~rankwise.parallel.ddp.reduction.reducer.Reducer` hooks every trainable parameter and
   all-reduces bucketed gradients while backward runs.

Before each forward (with ``broadcast_buffers``) rank 0's buffers, e.g. BatchNorm running
statistics, are broadcast so every replica normalises with the same statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from ... import validate
from ...checkpoint.state_dict import add_module_prefix, strip_module_prefix
from ...errors import ConfigError, ModelError
from .. import buckets as bucketing
from ..agreement import (
    broadcast_tensors,
    check_unfrozen,
    frozen_at_wrap,
    move_to_device,
    trainable_parameters,
    verify_same_model,
)
from ..buckets import DEFAULT_BUCKET_CAP_MB, assign_buckets
from .comm_hooks import HookFn, check_hook
from .devices import check_devices, group_size_and_rank
from .join import DDPJoinHook, sync_flag
from .logging_data import DDPLogger, clock
from .no_sync import gradient_sync_off
from .node import hierarchical, shared_reduce
from .options import buffer_sync, check_args, group_from_mesh, refuse_unsupported
from .reduction import passes
from .reduction.reducer import Reducer
from .reduction.sparse import sparse_flags


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism across processes: wrap a model that is already on its device.

    Accepts every argument of torch 2.13's ``DistributedDataParallel`` with the same meaning
    (docs/ddp.md lists the few that are accepted without effect or refused, and why).
    ``compression`` ('bf16' or 'fp16') sends gradients in half precision (see
    ``rankwise.parallel.ddp.compression``). ``shared_memory_reduce``: ranks on one machine over
    Gloo average large CPU buckets through shared memory (``rankwise.parallel.ddp.node.shared_reduce``);
    None uses it whenever every rank can, False never, True insists. ``hierarchical_reduce``:
    a job over several nodes sums inside each node through shared memory and only then across
    the network (``rankwise.parallel.ddp.node.hierarchical``); None whenever the job spans nodes
    and can, False never, True insists. At world size 1 (no
    process group, not launched) the wrapper communicates nothing and behaves like the bare
    module.

    Sync point: all ranks, at construction and in every synchronised backward pass (and in
    every forward when ``broadcast_buffers`` applies).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: list[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        compression: str | torch.dtype | None = None,
        shared_memory_reduce: bool | None = None,
        hierarchical_reduce: bool | None = None,
    ) -> None:
        check_args(module, device_ids, output_device, dim, process_group, bucket_cap_mb, compression)
        super().__init__()
        Joinable.__init__(self)
        unsupported = (delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision)
        refuse_unsupported(*unsupported, bucket_cap_mb_list, check_reduction)
        self.module, self.dim = module, dim
        self.process_group = process_group = group_from_mesh(process_group, device_mesh)
        self.world_size, self.rank = group_size_and_rank(process_group)
        checked = check_devices(module, device_ids, output_device, self.rank)
        self.device_ids, self.output_device = checked
        self.bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.broadcast_buffers, sync_at_init = buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view = True  # always: .grad is a view of its bucket
        self._requested_view = gradient_as_bucket_view  # what the logging record reports
        self._iterations = 0  # synchronised forwards with autograd on (the logger's iteration)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy, self.compression = batched_grad_copy, compression
        self.require_backward_grad_sync = self._forward_sync = True
        if self.world_size > 1 and init_sync:
            self._agree(sync_at_init)
        self._build_reducer(shared_memory_reduce, hierarchical_reduce)
        self._without_module_prefix()

    def _without_module_prefix(self) -> None:
        """``state_dict()`` without ``module.``; ``load_state_dict`` accepts both forms."""
        self.register_state_dict_post_hook(strip_module_prefix)
        self.register_load_state_dict_pre_hook(add_module_prefix)

    def _agree(self, with_buffers: bool) -> None:
        """Same model on every rank, then rank 0's parameters (and buffers). Sync point."""
        verify_same_model(self.module, self.process_group, self.rank)
        ignore = _ignored(self.module)
        named = [(n, p) for n, p in self.module.named_parameters() if n not in ignore]
        state = [p.detach() for p in _unique(p for _, p in named)]
        buffers = [b.detach() for n, b in self.module.named_buffers() if n not in ignore]
        buffers = buffers if with_buffers else []
        broadcast_tensors(state + buffers, self.process_group)

    def _build_reducer(
        self, shared_memory_reduce: bool | None = False, hierarchical_reduce: bool | None = False
    ) -> None:
        names, params = trainable_parameters(self.module, self.rank)
        ignore = _ignored(self.module)  # torch's _set_params_and_buffers_to_ignore_for_model
        names, params = [n for n in names if n not in ignore], [
            p for n, p in zip(names, params, strict=True) if n not in ignore
        ]
        sparse = sparse_flags(self.module, params)  # each travels alone: sparse.py
        dense = [i for i, s in enumerate(sparse) if not s]
        buckets = [
            replace(b, indices=tuple(dense[j] for j in b.indices))
            for b in assign_buckets(
                [params[i] for i in dense], self.bucket_cap_mb, solo_bytes=bucketing.SOLO_BYTES
            )
        ]
        shared = self._shared_buckets(buckets, shared_memory_reduce, hierarchical_reduce)
        # Parameters frozen now have no bucket: one unfrozen later would train on each rank's
        # own gradient, unaveraged (torch's DDP lets it): forward refuses it (check_unfrozen).
        # (One replica averages nothing: it may unfreeze as it likes.)
        self._frozen_at_wrap = (frozen_at_wrap(self.module, params, frozenset(ignore))
                                if self.world_size > 1 else [])  # fmt: skip
        # Every buffer, persistent or not, as torch's DDP broadcasts them.
        self._buffer_slots = [
            (mod, name)
            for prefix, mod in self.module.named_modules()
            for name, buf in mod._buffers.items()
            if buf is not None and f"{prefix}.{name}".lstrip(".") not in ignore
        ]
        self.reducer = Reducer(
            params,
            names,
            buckets,
            group=self.process_group,
            world_size=self.world_size,
            rank=self.rank,
            find_unused_parameters=self.find_unused_parameters,
            compression=self.compression,
            should_sync=self._should_sync,
            shared=shared,
            static_graph=self.static_graph,
            sparse=sparse,
        )
        self.reducer.on_pass_end = self._log_pass
        self._logger = DDPLogger()
        sizes = [b.nbytes for b in buckets] + [
            p.numel() * p.element_size() for p, s in zip(params, sparse, strict=True) if s
        ]
        self._logger.construction(self, params, sizes, self._requested_view)

    def _shared_buckets(
        self, buckets: list, shared_memory_reduce: bool | None, hierarchical_reduce: bool | None
    ) -> Any:
        """The shared-memory buckets (hierarchical across nodes, else one machine's), or None
        (Gloo's all-reduce). Collective: only from ``__init__``, where every rank is (not when
        one rank unpickles)."""
        for name, value in (("shared_memory_reduce", shared_memory_reduce),
                            ("hierarchical_reduce", hierarchical_reduce)):  # fmt: skip
            validate.switch(name, value, where="DistributedDataParallel()")  # "false" is truthy
            if self.compression is not None and value:
                raise ConfigError(
                    f"{name}=True with compression={self.compression!r}: compressed buckets "
                    "go through the process group's all-reduce",
                    fix="drop one of them: shared memory already avoids the copy compression "
                    "saves.",
                )
        if self.world_size == 1 or self.compression is not None:
            return None
        group, shared = self.process_group, shared_memory_reduce
        found = hierarchical.attach(buckets, group, hierarchical_reduce, shared)
        return found if found is not None else shared_reduce.attach(buckets, group, shared)

    def _log_pass(self) -> None:
        order = [i for b in self.reducer.buckets for i in b.indices] + self.reducer._sparse
        self._logger.pass_end(self.reducer, self._iterations - 1, order)

    def _should_sync(self) -> bool:
        # Asked when backward's first hook fires: no_sync() around the backward call counts, and
        # so does no_sync() around the forward that built the graph (torch's rule).
        return self.require_backward_grad_sync and self._forward_sync

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; broadcast rank 0's buffers first (Sync point: all ranks)."""
        start = clock()
        if self._frozen_at_wrap:
            check_unfrozen(self._frozen_at_wrap, "DistributedDataParallel", self.rank)
        self.reducer.prepare_for_forward()
        grad_on = torch.is_grad_enabled()
        if grad_on:  # a no_grad forward builds no graph, so it does not change the decision
            self._forward_sync = self.require_backward_grad_sync
            self._iterations += self.require_backward_grad_sync
            self.reducer.forward_in_backward = passes.nested()
        if self._join_config.enable:  # uneven inputs: tell the joined ranks what to shadow
            Join.notify_join_context(self)
            buffers = sync_flag(self, joined=False).item() > 0
        else:
            buffers = grad_on and self.require_backward_grad_sync
        if buffers and self.broadcast_buffers and self.world_size > 1 and self._buffer_slots:
            self._sync_buffers()
        if self.device_ids:
            inputs, kwargs = move_to_device((inputs, kwargs), self.device_ids[0])
        out = self.module(*inputs, **kwargs)
        self._logger.forward(start, clock())
        return out

    def _sync_buffers(self) -> None:
        """Rank 0's buffers into every replica's, leaving autograd's version counters alone.

        A forward may have saved a buffer for backward (BatchNorm's running statistics in a
        model called twice before one backward: siamese nets, D(real) + D(fake)); writing it
        through the buffer itself would bump its version and fail that backward on every rank
        but 0. ``.data`` is the same memory with a version counter of its own, which is what
        torch's C++ broadcast amounts to. The values written are rank 0's, as in torch.
        """
        # Read the buffers through their modules each time: a module may have reassigned one.
        bufs = [mod._buffers.get(name) for mod, name in self._buffer_slots]
        with torch.no_grad():
            broadcast_tensors([b.data for b in bufs if b is not None], self.process_group)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally: backward passes inside this block communicate nothing.

        Checked when backward runs (and, as in torch, when the forward ran), so it may wrap the
        forward and backward, or the backward alone. The next backward outside it averages the
        accumulated gradients.
        """
        return gradient_sync_off(self)

    # -- torch's public methods beyond forward ------------------------------------------------

    def register_comm_hook(self, state: object, hook: HookFn) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket) -> Future[Tensor]``.

        torch's signature, so torch's hooks (``torch.distributed.algorithms.ddp_comm_hooks``)
        run unchanged. Call once, before the first backward pass.
        """
        try:
            check_hook(hook, self.reducer._comm_hook is not None, self.compression)
        except Exception as exc:
            raise self._logger.error(exc) from None
        self.reducer.set_comm_hook(state, hook)
        self._logger.data["comm_hook"] = getattr(hook, "__qualname__", repr(hook))

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's DDP logging record (construction, runtime, errors): logging_data.py."""
        return dict(self._logger.data)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Record runtime fields every ``sample_rate``-th iteration (after the first ten)."""
        if sample_rate < 1:
            raise self._logger.error(
                ConfigError(
                    f"DDP runtime logging sample rate should be equal or greater than 1, got "
                    f"{sample_rate}",
                    fix="pass a positive integer.",
                )
            )
        self._logger.sample_rate = sample_rate

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join | contextlib.AbstractContextManager:
        """Context manager for uneven inputs across ranks (torch's ``Join``); see parallel/ddp/join.py."""
        if not divide_by_initial_world_size:
            raise ConfigError(
                "join(divide_by_initial_world_size=False) is not supported: gradients are "
                "always divided by the full world size",
                fix="use join() (the default, divide_by_initial_world_size=True).",
                rank=self.rank,
            )
        if enable and self.reducer._comm_hook is not None:
            raise ConfigError(
                "join() with a communication hook is not supported (a joined rank could not "
                "shadow the hook's collectives)",
                fix="use compression='fp16'/'bf16' instead of a hook, or even out the inputs.",
                rank=self.rank,
            )
        if self.world_size == 1 and not dist.is_initialized():
            return contextlib.nullcontext()  # unlaunched: no other rank to even out with
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        return DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.reducer.buckets[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _set_static_graph(self) -> None:
        """torch's (private, but used) switch for ``static_graph=True``; before training only."""
        if self.reducer.started:
            raise self._logger.error(
                ModelError(
                    "_set_static_graph() should be called before training loop starts",
                    fix="pass static_graph=True to DistributedDataParallel(...) instead.",
                    rank=self.rank,
                )
            )
        self.static_graph = True
        self.reducer.set_static_graph()
        self._logger.data["static_graph"] = 1

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Iterator[str]
    ) -> None:
        """torch's (private, used by tooling) way to keep named parameters and buffers out of
        DDP: neither checked, broadcast nor averaged (e.g. a ShardedTensor that is synced
        elsewhere). Call before wrapping."""
        module._ddp_params_and_buffers_to_ignore = list(params_and_buffers_to_ignore)

    # -- pickling / deepcopy: drop the process group and the hooks, rebuild them on load -------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("reducer", "process_group", "_buffer_slots"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Like torch: a loaded or copied wrapper talks to the default group (if any).
        self.process_group = None
        self.world_size, self.rank = group_size_and_rank(None, strict=False)
        Joinable.__init__(self)
        self._build_reducer()


def _ignored(module: nn.Module) -> set[str]:
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def _unique(params: Iterator[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in params if id(p) not in seen and not seen.add(id(p))]
