"""``model._get_ddp_logging_data()``: torch's DDP logging record, filled from our engine.

torch's DistributedDataParallel keeps a record of how it was built and how it runs (its C++
``Logger``); torch's own tests, profilers and fleet tooling read it as a dict of ints and
strings. :class:`DDPLogger` keeps the same keys with the same meanings, from our reducer:

- construction: module name, devices, ``broadcast_buffers``, bucket cap and bucket sizes (bytes,
  in reduction order), parameter count/bytes/dtypes, ``find_unused_parameters``,
  ``gradient_as_bucket_view`` (as passed; our ``.grad`` is always a bucket view), ``static_graph``
  (only when set, as torch),
  backend, world size, rank, the launch environment (``MASTER_ADDR`` ..., "N/A" when unset);
- ``comm_hook``: the registered hook's name (absent without one);
- per sampled iteration (every one of the first ten, then every ``sample_rate``-th, as torch):
  host times in ns since the epoch and durations, their running averages, the gradient-ready
  order, ``unused_parameter_size``;
- ``has_error``/``error``: the last error raised by the wrapper's own checks.

Buckets are fixed at construction (we never rebuild them), so after the first synchronised pass
``has_rebuilt_buckets`` is 1 and the "rebuilt" layout is the one in use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...job import env

_ENV_KEYS = {
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
    "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
}
_GLOO_ENV = {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME", "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}
_NCCL_ENV = {
    "nccl_socket_ifname": "NCCL_SOCKET_IFNAME",
    "nccl_blocking_wait": "NCCL_BLOCKING_WAIT",
    "nccl_async_error_handling": "NCCL_ASYNC_ERROR_HANDLING",
    "nccl_debug": "NCCL_DEBUG",
    "nccl_nthreads": "NCCL_NTHREADS",
    "nccl_ib_timeout": "NCCL_IB_TIMEOUT",
}
_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
}
_RUNTIME = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
            "backward_compute_comm_overlap_time")  # fmt: skip


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DDPLogger:
    """The logging record of one wrapper (see the module docstring for its keys)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.sample_rate = 100  # torch's default kDDPRuntimeLoggingSampleRate
        self._sums = dict.fromkeys(_RUNTIME, 0)
        self._samples = 0
        self._forward: tuple[int, int] = (0, 0)

    def construction(self, ddp: Any, params: Sequence[nn.Parameter], bucket_bytes: list[int],
                     requested_view: bool) -> None:  # fmt: skip
        """What torch records when the wrapper is built."""
        group = ddp.process_group
        backend = dist.get_backend(group) if dist.is_initialized() else "none"
        devices = {p.device for p in ddp.module.parameters()}
        out = ddp.output_device
        self.data.update(
            module_name=type(ddp.module).__name__,
            device_ids=", ".join(str(d.index) for d in ddp.device_ids or []),
            output_device=out.index if out is not None and out.index is not None else -1,
            broadcast_buffers=int(ddp.broadcast_buffers),
            has_sync_bn=int(any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules())),
            bucket_cap_bytes=int(ddp.bucket_cap_mb * 1024 * 1024),
            find_unused_parameters=int(ddp.find_unused_parameters),
            gradient_as_bucket_view=int(requested_view),
            backend_name=backend,
            world_size=ddp.world_size,
            rank=ddp.rank,
            iteration=0,
            is_multi_device_module=int(len(devices) > 1),
            num_parameter_tensors=len(params),
            total_parameter_size_bytes=sum(_nbytes(p) for p in params),
            dtypes=", ".join(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            bucket_sizes=", ".join(str(n) for n in bucket_bytes),
        )
        if ddp.static_graph:  # torch records it only when set
            self.data["static_graph"] = 1
        environ = env.snapshot()
        names = {**_ENV_KEYS, **(_GLOO_ENV if backend == "gloo" else {})}
        names.update(_NCCL_ENV if backend == "nccl" else {})
        self.data.update({key: environ.get(var, "N/A") for key, var in names.items()})
        if backend == "gloo":
            cpu = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
            self.data["gloo_num_threads"] = int(cpu.options._threads)

    def error(self, exc: BaseException) -> BaseException:
        """Record ``exc`` (torch's ``has_error``/``error``); returns it, to be raised."""
        self.data.update(has_error=1, error=str(exc))
        return exc

    def forward(self, start_ns: int, end_ns: int) -> None:
        self._forward = (start_ns, end_ns)

    def pass_end(self, reducer: Any, iteration: int, bucket_order: list[int]) -> None:
        """After a synchronised backward pass: the runtime fields, on sampled iterations."""
        self.data.update(
            has_rebuilt_buckets=1,
            rebuilt_bucket_sizes=self.data.get("bucket_sizes", ""),
            rebuilt_per_bucket_param_indices=" ".join(str(i) for i in bucket_order),
            prev_iteration_grad_ready_order_indices=", ".join(str(i) for i in reducer.order),
        )
        if not (iteration > 0 and (iteration < 10 or iteration % self.sample_rate == 0)):
            return
        fwd_start, fwd_end = self._forward
        times = reducer.times
        comm_start = times.get("comm_start", times["compute_end"])
        comm_end = times.get("comm_end", comm_start)
        now = {
            "forward_compute_time": fwd_end - fwd_start,
            "backward_compute_time": times["compute_end"] - fwd_end,
            "backward_comm_time": comm_end - comm_start,
            "backward_compute_comm_overlap_time": max(0, times["compute_end"] - comm_start),
        }
        self._samples += 1
        for key, value in now.items():
            self._sums[key] += value
            self.data[key] = value
            self.data["avg_" + key] = self._sums[key] // self._samples
        unused = [p for p, seen in zip(reducer.params, reducer.last_used, strict=True) if not seen]
        self.data.update(
            iteration=iteration,
            forward_compute_time_start=fwd_start,
            backward_compute_time_start=fwd_end,
            backward_compute_time_end=times["compute_end"],
            backward_comm_time_start=comm_start,
            backward_comm_time_end=comm_end,
            unused_parameter_size=sum(_nbytes(p) for p in unused),
        )


def clock() -> int:
    """Host time in ns since the epoch (torch's logger uses the same scale)."""
    return time.time_ns()
