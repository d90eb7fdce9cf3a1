"""``DistributedDataParallel``: one process per device, gradients averaged during backward.

Construction checks, then agrees, then listens:

1. **Check** the module is where it will compute (docs/pitfalls.md#pitfall-1 becomes a message that
   says what to move where) and that there is a process group when the job has several ranks.
2. **Agree**: compare parameter names, shapes and dtypes across ranks (a mismatch names the
   first differing parameter and both ranks), then broadcast rank 0's parameters and buffers,
   once. From then on replicas stay identical because they apply identical averaged gradients.
3. **Listen**: a :class:`~rankwise.parallel.ddp.reducer.Reducer` hooks every trainable parameter and
   all-reduces bucketed gradients while backward runs.

Before each forward (with ``broadcast_buffers``) rank 0's buffers, e.g. BatchNorm running
statistics, are broadcast so every replica normalises with the same statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from ... import runtime
from ...errors import ConfigError, ModelError, NoProcessGroupError
from ...state_dict import add_module_prefix, strip_module_prefix
from .. import buckets as bucketing
from ..agreement import (
    broadcast_tensors,
    move_to_device,
    trainable_parameters,
    verify_same_model,
)
from ..buckets import DEFAULT_BUCKET_CAP_MB, assign_buckets
from . import compression as comp
from . import shared_reduce
from .comm_hooks import HookFn, check_hook
from .join import DDPJoinHook, sync_flag
from .no_sync import gradient_sync_off
from .options import buffer_sync, group_from_mesh, refuse_unsupported
from .reducer import Reducer


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism across processes: wrap a model that is already on its device.

    Accepts every argument of torch 2.13's ``DistributedDataParallel`` with the same meaning
    (docs/ddp.md lists the few that are accepted without effect or refused, and why).
    ``compression`` ('bf16' or 'fp16') sends gradients in half precision (see
    ``rankwise.parallel.ddp.compression``). ``shared_memory_reduce``: ranks on one machine over
    Gloo average large CPU buckets through shared memory (``rankwise.parallel.ddp.shared_reduce``);
    None uses it whenever every rank can, False never, True insists. At world size 1 (no
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
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        unsupported = (delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision)
        refuse_unsupported(*unsupported, bucket_cap_mb_list, check_reduction)
        self.module = module
        self.process_group = process_group = group_from_mesh(process_group, device_mesh)
        self.world_size, self.rank = _group_size_and_rank(process_group)
        self.device_ids, self.output_device = _check_devices(
            module, device_ids, output_device, self.rank
        )
        _check_no_sparse(module, self.rank, compression)  # before any collective
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.dim, self.bucket_cap_mb = dim, cap
        self.broadcast_buffers, sync_at_init = buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view = True  # always: .grad is a view of its bucket
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy, self.compression = batched_grad_copy, compression
        self.require_backward_grad_sync = self._forward_sync = True
        if self.world_size > 1 and init_sync:
            self._agree(sync_at_init)
        self._build_reducer(shared_memory_reduce)
        self.register_state_dict_post_hook(strip_module_prefix)
        self.register_load_state_dict_pre_hook(add_module_prefix)

    def _agree(self, with_buffers: bool) -> None:
        """Same model on every rank, then rank 0's parameters (and buffers). Sync point."""
        verify_same_model(self.module, self.process_group, self.rank)
        state = [p.detach() for p in _unique(self.module.parameters())]
        buffers = [b.detach() for b in self.module.buffers()] if with_buffers else []
        broadcast_tensors(state + buffers, self.process_group)

    def _build_reducer(self, shared_memory_reduce: bool | None = False) -> None:
        names, params = trainable_parameters(self.module, self.rank)
        buckets = assign_buckets(params, self.bucket_cap_mb, solo_bytes=bucketing.SOLO_BYTES)
        # Collective: only from __init__, where every rank is (not when one rank unpickles).
        shared = None
        if self.compression is not None and shared_memory_reduce:
            raise ConfigError(
                f"shared_memory_reduce=True with compression={self.compression!r}: compressed "
                "buckets go through the process group's all-reduce",
                fix="drop one of them: shared memory already avoids the copy compression saves.",
            )
        if self.world_size > 1 and self.compression is None:
            shared = shared_reduce.attach(buckets, self.process_group, shared_memory_reduce)
        # Every buffer, persistent or not, as torch's DDP broadcasts them.
        self._buffer_slots = [
            (mod, name)
            for mod in self.module.modules()
            for name, buf in mod._buffers.items()
            if buf is not None
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
        )

    def _should_sync(self) -> bool:
        # Asked when backward's first hook fires: no_sync() around the backward call counts, and
        # so does no_sync() around the forward that built the graph (torch's rule).
        return self.require_backward_grad_sync and self._forward_sync

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; broadcast rank 0's buffers first (Sync point: all ranks)."""
        self.reducer.prepare_for_forward()
        grad_on = torch.is_grad_enabled()
        if grad_on:  # a no_grad forward builds no graph, so it does not change the decision
            self._forward_sync = self.require_backward_grad_sync
        if self._join_config.enable:  # uneven inputs: tell the joined ranks what to shadow
            Join.notify_join_context(self)
            buffers = sync_flag(self, joined=False).item() > 0
        else:
            buffers = grad_on and self.require_backward_grad_sync
        if buffers and self.broadcast_buffers and self.world_size > 1 and self._buffer_slots:
            self._sync_buffers()
        if self.device_ids:
            inputs, kwargs = move_to_device((inputs, kwargs), self.device_ids[0])
        return self.module(*inputs, **kwargs)

    def _sync_buffers(self) -> None:
        # Read the buffers through their modules each time: a module may have reassigned one.
        bufs = [mod._buffers.get(name) for mod, name in self._buffer_slots]
        with torch.no_grad():
            broadcast_tensors([b for b in bufs if b is not None], self.process_group)

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
        check_hook(hook, self.reducer._comm_hook is not None, self.compression)
        self.reducer.set_comm_hook(state, hook)

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
            raise ModelError(
                "_set_static_graph() should be called before training loop starts",
                fix="pass static_graph=True to DistributedDataParallel(...) instead.",
                rank=self.rank,
            )
        self.static_graph = True

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
        self.world_size, self.rank = _group_size_and_rank(None, strict=False)
        Joinable.__init__(self)
        self._build_reducer()


def _unique(params: Iterator[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in params if id(p) not in seen and not seen.add(id(p))]


def _group_size_and_rank(group: dist.ProcessGroup | None, strict: bool = True) -> tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) when running alone without a process group."""
    if group is not None:
        return dist.get_world_size(group), dist.get_rank(group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    env = runtime.coords()
    if env.world_size > 1 and strict:
        raise NoProcessGroupError(
            f"DistributedDataParallel needs a process group: this process is rank {env.rank} "
            f"of WORLD_SIZE={env.world_size} (from {env.source}), but torch.distributed is "
            "not initialised",
            fix="call `rt = rw.init()` at the start of the program, before wrapping the model.",
            rank=env.rank,
        )
    return 1, 0


def _check_devices(
    module: nn.Module,
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
    rank: int,
) -> tuple[list[torch.device] | None, torch.device | None]:
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if device_ids is None:
        return None, None if output_device is None else _as_device(output_device)
    ids = [_as_device(d) for d in device_ids]
    shown = sorted(str(d) for d in devices)
    if len(ids) != 1:
        raise ConfigError(
            f"device_ids={list(device_ids)!r} names {len(ids)} devices; DistributedDataParallel "
            "drives one device per process",
            fix="pass device_ids=[local_rank] (one process per device), or device_ids=None for "
            "a module that spans several devices.",
            rank=rank,
        )
    if len(devices) > 1:
        raise ConfigError(
            f"the module spans devices {shown} but device_ids={list(device_ids)!r}",
            fix="pass device_ids=None for a module split over several devices.",
            rank=rank,
        )
    if devices and devices != {ids[0]}:
        raise ConfigError(
            f"the module's parameters are on {shown[0]} but device_ids={list(device_ids)!r} "
            f"asks for {ids[0]}",
            fix=f"move the model to {_fix_device(ids[0])} (or rt.device) before wrapping: "
            "model = Net().to(rt.device); DistributedDataParallel(model, "
            "device_ids=[rt.local_rank]).",
            rank=rank,
        )
    out = ids[0] if output_device is None else _as_device(output_device)
    return ids, out


def _fix_device(device: torch.device) -> str:
    return "cuda:K" if device.type == "cuda" else str(device)


def _as_device(d: int | str | torch.device) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    dev = torch.device(d)
    if dev.type == "cuda" and dev.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return dev


def _check_no_sparse(
    module: nn.Module, rank: int, compression: str | torch.dtype | None = None
) -> None:
    comp.wire_dtype(compression)  # a bad compression name is refused here too
    for name, mod in module.named_modules():
        if getattr(mod, "sparse", False) is True and isinstance(
            mod, (nn.Embedding, nn.EmbeddingBag)
        ):
            raise ConfigError(
                f"module {name or type(mod).__name__} has sparse=True; sparse gradients are not "
                "supported by rankwise's DistributedDataParallel",
                fix="construct the embedding with sparse=False (the default).",
                rank=rank,
            )
