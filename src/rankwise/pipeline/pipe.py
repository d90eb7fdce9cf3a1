"""``rw.split(model, devices, balance, chunks)``: one model, consecutive layers on several devices.

Model parallelism in the classic sense: a model too big for one device is cut into stages, each
on its own device, and every stage sees the (transformed) same input. The forward moves the
activation from one stage's device to the next with ``Tensor.to``, which autograd records, so
``loss.backward()`` moves the gradients back the same way; nothing here touches gradients.

With ``chunks=m`` the batch is cut into ``m`` micro-batches that flow through the stages in
GPipe order (``schedule.run_pipelined``), so stage 2 works on micro-batch 1 while stage 1 works
on micro-batch 2. The micro-batch outputs are concatenated: for layers that treat samples
independently the result and the gradients are the unsplit model's. (BatchNorm sees
micro-batch statistics, as in GPipe.) The backward is autograd's: on CUDA it runs one thread
per device, so the stages' backward passes overlap too; on CPU placeholders autograd uses the
calling thread, so only the forward is pipelined there.

The result is a plain ``nn.Module`` whose parameters live on several devices and keep the
original model's names (``state_dict`` keys are the unsplit model's), so a data-parallel
wrapper with ``device_ids=None`` can wrap it: DDP over model-parallel replicas.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..job.devices import resolve_device
from ..validate import choice, fail, integer
from . import partition, schedules
from .execution import gpipe as schedule
from .execution import step
from .execution.threads import run_in_threads
from .execution.weight_pass import WeightPass


def _check_chunks(chunks: int) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(
            f"chunks={chunks!r} must be an integer >= 1 (the number of micro-batches per batch)",
            fix="use chunks=1 for no pipelining, or e.g. chunks=4 (about 4x the number of stages "
            "keeps the pipeline bubble small).",
        )
    return chunks


def _check_devices(devices: Sequence[str | int | torch.device]) -> list[torch.device]:
    if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__") or not devices:
        raise ConfigError(
            f"devices={devices!r} must be a non-empty list, one device per stage",
            fix="pass e.g. devices=['cuda:0', 'cuda:1'] (or ['cpu', 'cpu'] to try it on CPU).",
        )
    return [resolve_device(d, f"devices[{k}]") for k, d in enumerate(devices)]


def _check_pipe(layers: Any, devices: Any, balance: Any, chunks: Any, per_device: Any) -> None:
    """``Pipe``'s arguments, as ``rw.split`` would have made them."""
    integer("stages_per_rank", per_device, minimum=1, where="rw.Pipe()", example=2)
    pairs = isinstance(layers, Sequence) and not isinstance(layers, str)
    if not pairs or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], nn.Module) for p in layers
    ):
        fail("layers", layers, "a list of (name, module) pairs", where="rw.Pipe()",
             fix="build the pipeline with rw.split(model, devices), which makes the pairs.")
    stages = len(_check_devices(devices)) * per_device
    if isinstance(balance, Sequence) and len(balance) != stages:
        per = "stage" if per_device == 1 else f"{per_device} stages"
        fail("devices", devices, f"one device per {per} of balance={list(balance)!r}",
             where="rw.Pipe()", fix="give as many devices as balance has stages.")
    partition.check_balance(balance, len(layers), stages)
    _check_chunks(chunks)


class Pipe(nn.Module):
    """A sequential model split into stages on devices, run as a GPipe pipeline.

    Build it with ``rw.split``. Attributes: ``devices`` (one per position), ``balance`` (layers
    per stage), ``chunks``, ``partitions`` (one ``nn.Sequential`` per stage; stage ``s`` on
    ``devices[s % len(devices)]``), ``last_schedule`` (the ``ScheduleEvent``s of the last
    forward). ``train_step`` runs a whole step on ``schedule`` (``schedules.py``) instead of
    the GPipe forward + autograd's backward. Sync point: none (one process).
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        devices: Sequence[torch.device],
        balance: Sequence[int],
        chunks: int,
        schedule_name: str = "1f1b",
        stages_per_rank: int = 1,
    ) -> None:
        choice("schedule_name", schedule_name, schedules.SCHEDULES, where="rw.Pipe()")
        _check_pipe(layers, devices, balance, chunks, stages_per_rank)
        super().__init__()
        self.devices = list(devices)
        self.balance = list(balance)
        self.chunks = chunks
        self.schedule_name, self.stages_per_rank = schedule_name, stages_per_rank
        self.stage_devices = [self.devices[s % len(self.devices)] for s in range(len(self.balance))]
        self.last_schedule: list[schedule.ScheduleEvent] = []
        self.last_step: list = []
        """What each position ran in the last ``train_step`` (``executor.StepResult``)."""
        partitions, start = [], 0
        for dev, size in zip(self.stage_devices, self.balance, strict=True):
            named = OrderedDict(layers[start : start + size])
            for name, layer in named.items():
                self.add_module(name, layer.to(dev))  # original names: state_dict keys unchanged
            partitions.append(nn.Sequential(named))
            start += size
        # A plain list: the layers are registered once, above, under their own names.
        self.__dict__["partitions"] = partitions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run ``x`` through every stage; the output is on the last stage's device."""
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"a split model takes one tensor, got {type(x).__name__}",
                fix="pass a single batch tensor (dimension 0 = samples); pack several inputs "
                "into one tensor, or into the first layer's own module.",
            )
        micro = [mb for mb in torch.tensor_split(x, self.chunks, dim=0) if mb.shape[0] > 0]
        if not micro:  # an empty batch still goes through once, as the unsplit model would
            micro = [x]
        stages = [self._stage_fn(j) for j in range(len(self.partitions))]
        if len(micro) == 1 or len(stages) == 1:
            outputs, events = schedule.run_sequential(stages, micro)
        else:
            setup = self._thread_setup(x, self.stage_devices)
            outputs, events = schedule.run_pipelined(stages, micro, setup)
        self.last_schedule = sorted(events, key=lambda e: (e.start, e.stage))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _stage_fn(self, j: int) -> schedule.StageFn:
        device, layers = self.stage_devices[j], self.partitions[j]

        def run(i: int, x: torch.Tensor) -> torch.Tensor:
            try:
                y = layers(x.to(device))
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"(in pipeline stage {j} on {device}, micro-batch {i})")
                raise
            if not isinstance(y, torch.Tensor):
                raise ConfigError(
                    f"pipeline stage {j} returned {type(y).__name__}, not a tensor",
                    fix="every layer of a split model must return one tensor; wrap layers "
                    "that return tuples in a module that returns the tensor to pass on.",
                )
            return y

        return run

    def train_step(
        self, x: torch.Tensor, target: torch.Tensor, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward of one batch on ``schedule``, one thread per device; the
        gradients of the batch loss (``loss_fn`` a mean over samples) accumulate in ``.grad``.
        Returns the batch loss (detached)."""
        micro = step.micro_batches(x, self.chunks)
        targets = step.micro_batches(target, len(micro))
        weights = step.loss_weights([t.shape[0] for t in targets], "mean")
        sched = step.schedule_for(self.schedule_name, len(self.devices), len(micro),
                                  self.stages_per_rank)  # fmt: skip
        positions = [_PipeStages(self, j, micro, targets, loss_fn) for j in range(len(self.devices))]
        passes = [WeightPass(_modules_of(self, j)) if sched.split_backward else None
                  for j in range(len(self.devices))]  # fmt: skip
        try:
            self.last_step = run_in_threads(sched, positions, lambda i: weights[i], passes,
                                            self._thread_setup(x, self.devices))  # fmt: skip
        finally:
            for wp in passes:
                if wp is not None:
                    wp.remove()
        for result in self.last_step:
            step.land_grads(self.parameters(), result.grads)
        losses = self.last_step[-1].losses
        return step.batch_loss(losses, weights)

    def _thread_setup(
        self, x: torch.Tensor, devices: list[torch.device]
    ) -> Callable[[int], contextlib.ExitStack]:
        """The caller's thread-local state, re-entered in each stage thread.

        Grad mode, autocast, the current device and the current CUDA stream belong to a thread.
        A stage thread left on the default stream could read an activation the caller's stream
        is still writing (a ``non_blocking`` input copy, a previous stage), and the caller could
        read outputs too early; on the caller's streams of every device involved, the stages are
        ordered exactly as in the sequential run (docs/model-parallel.md, CUDA streams).
        """
        grad = torch.is_grad_enabled()
        cuda = {d for d in [*devices, x.device] if d.type == "cuda"}
        streams = [torch.cuda.current_stream(d) for d in sorted(cuda, key=str)]
        kinds = sorted({d.type for d in devices} | {"cpu"})
        autocast = [(k, torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k)]

        def setup(j: int) -> contextlib.ExitStack:
            stack = contextlib.ExitStack()
            stack.enter_context(torch.set_grad_enabled(grad))
            for stream in streams:
                stack.enter_context(torch.cuda.stream(stream))
            if devices[j].type == "cuda":  # last: entering a stream also switches the device
                stack.enter_context(torch.cuda.device(devices[j]))
            for kind, dtype in autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            return stack

        return setup

    def _refuse_move(self, how: str):
        raise ConfigError(
            f"{how} would move every stage of the split model to one device and undo the split "
            f"over {[str(d) for d in self.devices]}",
            fix="choose the devices in rw.split(model, devices=[...]); to change the dtype "
            "only, use .to(dtype) or .double()/.half().",
        )

    def to(self, *args, **kwargs):
        device, _, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            self._refuse_move(f".to({device})")
        return super().to(*args, **kwargs)

    def cuda(self, device=None):
        self._refuse_move(".cuda()")

    def cpu(self):
        self._refuse_move(".cpu()")

    def extra_repr(self) -> str:
        devs = [str(d) for d in self.devices]
        return (f"devices={devs}, balance={self.balance}, chunks={self.chunks}, "
                f"schedule={self.schedule_name!r}, stages_per_rank={self.stages_per_rank}")


class _PipeStages:
    """Position ``j`` of a ``Pipe`` for the executor: its partitions, the micro-batches (first
    stage), the targets and the loss (last stage)."""

    def __init__(self, pipe: Pipe, j: int, micro: list, targets: list, loss_fn) -> None:
        self.pipe, self.micro, self.targets, self.loss_fn = pipe, micro, targets, loss_fn
        self._params = {
            s: [p for p in pipe.partitions[s].parameters() if p.requires_grad]
            for s in range(j, len(pipe.partitions), len(pipe.devices))
        }

    def run(self, stage: int, micro_batch: int, x: Any) -> Any:
        return self.pipe.partitions[stage](x.to(self.pipe.stage_devices[stage]))

    def first_input(self, micro_batch: int) -> Any:
        return self.micro[micro_batch]

    def loss(self, micro_batch: int, output: Any) -> torch.Tensor:
        return self.loss_fn(output, self.targets[micro_batch].to(output.device))

    def parameters_of(self, stage: int) -> list[nn.Parameter]:
        return self._params[stage]


def _modules_of(pipe: Pipe, j: int) -> list[nn.Module]:
    parts = pipe.partitions[j :: len(pipe.devices)]
    return [m for part in parts for m in part.modules()]


def split(
    model: nn.Module,
    devices: Sequence[str | int | torch.device],
    balance: Sequence[int] | None = None,
    chunks: int = 1,
    *,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
) -> Pipe:
    """Split a sequential model over ``devices``; with ``chunks > 1``, pipeline micro-batches.

    ``balance`` gives the number of consecutive layers per stage; ``None`` balances by
    parameter count (see ``balance_by_params``; ``balance_by_time`` measures instead). The
    layers are moved to their devices in place (the returned module shares them with
    ``model``). Inputs may be on any device; the output is on the last stage's device.
    ``schedule``/``stages_per_rank``: what ``pipe.train_step`` runs (``stages_per_rank``
    virtual stages per device: ``len(devices) x stages_per_rank`` stages, stage ``s`` on
    ``devices[s % len(devices)]``, one ``balance`` entry each).

    >>> pipe = rw.split(nn.Sequential(a, b, c, d), devices=["cuda:0", "cuda:1"], chunks=4)
    """
    layers = partition.layers_of(model)
    devs = _check_devices(devices)
    chunks = _check_chunks(chunks)
    v = schedules.make(schedule, len(devs), 1, stages_per_rank).stages_per_rank
    if balance is None:
        bal = partition.balance_by_params(model, len(devs) * v)
    else:
        bal = partition.check_balance(balance, len(layers), len(devs) * v)
    return Pipe(layers, devs, bal, chunks, schedule, v)
