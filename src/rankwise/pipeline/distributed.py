"""``DistributedPipeline``: the stages of one model in different processes, trained on a
schedule.

Every rank builds the same ``nn.Sequential`` and keeps only its own layers, on its own device.
``schedule=`` says in which order each rank runs the forward and backward passes of the
micro-batches (``schedules.py``: ``"1f1b"``, the default, ``"gpipe"``, ``"interleaved_1f1b"``
with ``stages_per_rank`` virtual stages per rank, ``"zero_bubble"``); one executor runs them
all (``execution/executor.py``), moving activations and gradients with point-to-point sends. The
gradients left in ``.grad`` are those of the loss of the whole batch, so ``optimizer.step()``
after ``train_step`` trains the model exactly as one process would.

Data parallel on top: give ``data_parallel_group`` (from ``dist.new_group``), the ranks that
hold the SAME stage in different pipeline replicas; after the backward the stage's gradients
are averaged over that group, as DDP would average them.

On a device mesh (``rw.init(mesh={"pipeline": 2, "data": D, "tensor": T})``, the default when
``rt.mesh`` exists, or ``mesh=``): the stages are this rank's pipeline group and the gradients
are averaged over its data group. Tensor-parallel stages: split the model first with
``rw.tensor_parallel(model, plan, group=mesh.group("tensor"))``; tensor rank t of stage k then
sends to tensor rank t of stage k + 1 (each tensor rank holds the whole activation) and the
stage's tensor-parallel collectives run inside its group (docs/model-parallel.md).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .. import runtime, validate
from ..comm import collectives as comm
from ..comm.flat import FlatParams
from ..errors import ConfigError
from ..job.devices import resolve_device
from ..job.mesh import DeviceMesh
from ..parallel.ddp.no_sync import gradient_sync_off
from . import partition, schedules
from .execution import p2p, step
from .execution.executor import Executor, StepResult
from .execution.weight_pass import WeightPass
from .pipe import _check_chunks

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_ranks(ranks: Sequence[int] | None, world: int, rank: int) -> list[int]:
    ranks = list(range(world)) if ranks is None else list(ranks)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ConfigError(
            f"ranks={ranks} must be distinct ranks in 0..{world - 1} (world size {world}), "
            "one per stage, first stage first",
            fix=f"pass e.g. ranks={list(range(world))}, or start more processes.",
            rank=rank,
        )
    if rank not in ranks:
        raise ConfigError(
            f"this process (rank {rank}) holds no stage of the pipeline ranks={ranks}",
            fix="build one DistributedPipeline per pipeline replica and pass each rank the "
            "ranks of its own replica (e.g. ranks=[0, 1] on ranks 0-1, [2, 3] on ranks 2-3).",
            rank=rank,
        )
    return ranks


def _check_arguments(ranks: object, device: object, group: object, mesh: object) -> None:
    """By type, before the mesh or the ranks are read (``rankwise.validate``); values are checked where
    they are used (``_check_ranks``, ``check_balance``)."""
    where = "DistributedPipeline()"
    if ranks is not None:
        validate.sequence("ranks", ranks, "a list of ranks, one per stage", where=where,
                          example="[0, 1]")  # fmt: skip
    validate.device_name("device", device, where=where)
    validate.process_group("data_parallel_group", group, where=where)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        validate.fail("mesh", mesh, "a rw.DeviceMesh (rt.mesh) or None", where=where,
                      fix="pass mesh=rt.mesh (from rw.init(mesh={...})), or ranks=[...].")


def _from_mesh(mesh, default, ranks, group, rank: int):
    """(ranks, data group) from ``mesh`` (or the runtime's ``default`` mesh, when neither
    ``ranks`` nor ``group`` is given); as given without a mesh."""
    if mesh is not None and (ranks is not None or group is not None):
        raise ConfigError(
            f"DistributedPipeline got mesh ({mesh.describe()}) and also "
            f"{'ranks=' if ranks is not None else 'data_parallel_group='}",
            fix="pass mesh= alone (its pipeline groups are the stages, its data group averages "
            "the gradients), or ranks= and data_parallel_group= without it.",
            rank=rank,
        )
    mesh = mesh if mesh is not None or ranks is not None or group is not None else default
    if mesh is None:
        return ranks, group
    return mesh.ranks("pipeline"), mesh.group("data")


class DistributedPipeline(nn.Module):
    """This rank's stage(s) of a sequential model pipelined over ``ranks``.

    ``schedule``: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved_1f1b"`` or
    ``"zero_bubble"``; ``stages_per_rank``: virtual stages per rank (interleaving: the model
    is cut into ``len(ranks) x stages_per_rank`` stages, rank ``k`` holds stages ``k``,
    ``k + len(ranks)``, ...; ``balance`` then has one entry per stage).
    Parameters keep the full model's names (``state_dict`` keys are a subset of the unsplit
    model's), so each rank can save its part and the parts merge into a full checkpoint.
    Call ``rw.init()`` first. Sync point: every method below is one for the pipeline's ranks.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ranks: Sequence[int] | None = None,
        balance: Sequence[int] | None = None,
        chunks: int = 1,
        device: str | torch.device | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        mesh: DeviceMesh | None = None,
        schedule: str = "1f1b",
        stages_per_rank: int | None = None,
    ) -> None:
        _check_arguments(ranks, device, data_parallel_group, mesh)
        super().__init__()
        rt = runtime.get_runtime()
        self.rank = comm.rank()
        ranks, data_parallel_group = _from_mesh(
            mesh, rt.mesh, ranks, data_parallel_group, self.rank
        )
        self.ranks = _check_ranks(ranks, comm.world_size(), self.rank)
        self.chunks = _check_chunks(chunks)
        self.schedule_name = schedule
        self.stages_per_rank = schedules.make(schedule, len(self.ranks), 1, stages_per_rank).stages_per_rank
        self.loss_reduction = _check_reduction(loss_reduction)
        self.stage_index = self.ranks.index(self.rank)
        self.device = resolve_device(device if device else rt.device, "device")
        self._place(model, balance)
        self.data_parallel_group = data_parallel_group
        self.require_backward_grad_sync = True
        """False inside ``no_sync()``: ``train_step`` leaves the gradients un-averaged."""
        nccl = rt.backend is not None and "nccl" in rt.backend
        self._link = p2p.Link(self.device if nccl else torch.device("cpu"), rt.timeout, self.rank)
        self._weight_pass: WeightPass | None = None
        self.last_step: StepResult | None = None
        """What the last ``train_step`` ran on this rank (actions with times, waits)."""

    def _place(self, model: nn.Module, balance: Sequence[int] | None) -> None:
        layers = partition.layers_of(model)
        num_stages = len(self.ranks) * self.stages_per_rank
        if balance is None:
            self.balance = partition.balance_by_params(model, num_stages)
        else:
            self.balance = partition.check_balance(balance, len(layers), num_stages)
        starts = [sum(self.balance[:s]) for s in range(num_stages)]
        self.stage_modules: dict[int, nn.Sequential] = {}
        for s in range(self.stage_index, num_stages, len(self.ranks)):
            mine = OrderedDict(layers[starts[s] : starts[s] + self.balance[s]])
            for name, layer in mine.items():
                self.add_module(name, layer.to(self.device))
            self.stage_modules[s] = nn.Sequential(mine)
        self.__dict__["stage"] = self.stage_modules[self.stage_index]  # not registered twice

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == len(self.ranks) - 1

    def train_step(
        self, x: torch.Tensor | None, target: torch.Tensor | None, loss_fn: LossFn
    ) -> torch.Tensor:
        """Forward and backward of one batch; gradients of the batch loss accumulate in ``.grad``.

        ``x`` is read on the first stage and ``target`` on the last (others may pass None).
        Returns the batch loss (detached) on every stage: the last stage sends it to the
        others, so any rank can log or print it. Does not step or zero the optimizer.
        Sync point: the pipeline's ranks (and ``data_parallel_group``).
        """
        result, weights = self._run(x, target, loss_fn, forward_only=False)
        step.land_grads(self.parameters(), result.grads)
        if self.require_backward_grad_sync:
            self._average_gradients()
        loss = step.batch_loss(result.losses, weights) if self.is_last else None
        return step.share_loss(self._link, self.ranks, self.stage_index, loss)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally: ``train_step`` inside does not average them over
        ``data_parallel_group`` (activations still flow between stages); the next one outside
        averages the sum. What ``rt.accumulate`` uses."""
        return gradient_sync_off(self)

    def forward(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Pipelined forward only (evaluation): the output on the last stage, None elsewhere.

        Sync point: the pipeline's ranks.
        """
        result, _ = self._run(x, None, None, forward_only=True)
        if not self.is_last:
            return None
        return torch.cat([result.outputs[i] for i in sorted(result.outputs)], dim=0)

    def _run(self, x, target, loss_fn, forward_only: bool) -> tuple[StepResult, list[float]]:
        if self.is_first:
            micro = step.micro_batches(self._first_input(x), self.chunks)
            count, prefetched = len(micro), {}
        else:
            micro = []
            count, prefetched = step.first_activation(self._link, self.ranks, self.stage_index)
        sched = step.schedule_for(self.schedule_name, len(self.ranks), count, self.stages_per_rank)
        targets: list[Any] = []
        if self.is_last and not forward_only:
            targets = step.micro_batches(self._target(target), count)
        weights = step.loss_weights([t.shape[0] for t in targets], self.loss_reduction)
        stages = _SequentialStages(self, micro, targets, loss_fn)
        executor = Executor(
            sched, self.stage_index, stages,
            step.ProcessTransport(self._link, self.ranks, sched.micro_batches),
            seed=lambda i: weights[i], weight_pass=self._weights_for(sched), prefetched=prefetched,
        )  # fmt: skip
        result = executor.run(forward_only=forward_only)
        self.last_step = result
        return result, weights

    def _weights_for(self, sched: schedules.Schedule) -> WeightPass | None:
        if sched.split_backward and self._weight_pass is None:
            self._weight_pass = WeightPass(self.modules())
        return self._weight_pass if sched.split_backward else None

    def _first_input(self, x: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"the first pipeline stage (rank {self.rank}) needs the input batch, got "
                f"{type(x).__name__}",
                fix="pass the batch tensor as x to train_step/forward on the first stage.",
                rank=self.rank,
            )
        return x.to(self.device)

    def _target(self, target: Any) -> torch.Tensor:
        if not isinstance(target, torch.Tensor):
            raise ConfigError(
                f"the last pipeline stage (rank {self.rank}) computes the loss and needs the "
                f"target batch, got {type(target).__name__}",
                fix="pass the targets as target to train_step on the last stage.",
                rank=self.rank,
            )
        return target.to(self.device)

    def _average_gradients(self) -> None:
        """Mean of this stage's gradients over ``data_parallel_group``, in one flat buffer.

        Sync point: the ranks of ``data_parallel_group``.
        """
        group = self.data_parallel_group
        if group is None or dist.get_world_size(group) == 1:
            return
        with_grads = [p for p in self.parameters() if p.grad is not None]
        if not with_grads:
            comm.all_reduce_(torch.zeros(0), "mean", group=group, label="no gradients")
            return
        flat = FlatParams(with_grads)
        label = f"stage {self.stage_index} gradients"
        grads = comm.all_reduce_(
            flat.grads(), "mean", group=group, label=label, timeout=self._link.timeout
        )
        flat.load_grads(grads)

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage_index} of {len(self.ranks)}, ranks={self.ranks}, "
            f"balance={self.balance}, chunks={self.chunks}, schedule={self.schedule_name!r}, "
            f"stages_per_rank={self.stages_per_rank}, device={self.device}"
        )


class _SequentialStages:
    """The executor's view of a ``DistributedPipeline`` rank: its layers per stage, the
    micro-batches (first stage), the targets and the loss function (last stage)."""

    def __init__(self, pipe: DistributedPipeline, micro: list, targets: list, loss_fn) -> None:
        self.pipe, self.micro, self.targets, self.loss_fn = pipe, micro, targets, loss_fn
        self._params = {
            s: [p for p in mod.parameters() if p.requires_grad]
            for s, mod in pipe.stage_modules.items()
        }

    def run(self, stage: int, micro_batch: int, x: Any) -> Any:
        return self.pipe.stage_modules[stage](x.to(self.pipe.device))

    def first_input(self, micro_batch: int) -> Any:
        return self.micro[micro_batch]

    def loss(self, micro_batch: int, output: Any) -> torch.Tensor:
        return self.loss_fn(output, self.targets[micro_batch].to(output.device))

    def parameters_of(self, stage: int) -> list[nn.Parameter]:
        return self._params[stage]


def _check_reduction(loss_reduction: str) -> str:
    if loss_reduction not in ("mean", "sum"):
        raise ConfigError(
            f"loss_reduction={loss_reduction!r} must be 'mean' or 'sum'",
            fix="say how loss_fn reduces over samples ('mean' is torch's default).",
        )
    return loss_reduction
