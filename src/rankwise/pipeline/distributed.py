"""``DistributedPipeline``: the stages of one model in different processes, trained with GPipe.

Every rank builds the same ``nn.Sequential`` and keeps only its own consecutive layers, on its
own device. A training step is GPipe's: all micro-batches forward (rank ``k`` receives an
activation from rank ``k-1``, runs its layers, sends the result to ``k+1``; the last stage
computes the loss), then all micro-batches backward in reverse (gradients go upstream the same
way). Sends are asynchronous, so rank 0 computes micro-batch 2 while rank 1 computes
micro-batch 1. The gradients left in ``.grad`` are those of the loss of the whole batch, so
``optimizer.step()`` after ``train_step`` trains the model exactly as one process would.

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
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from .. import comm, runtime, validate
from ..devices import resolve_device
from ..errors import ConfigError
from ..flat import FlatParams
from ..mesh import DeviceMesh
from ..parallel.ddp.no_sync import gradient_sync_off
from . import p2p, partition
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
    """By type, before the mesh or the ranks are read (validate.py); values are checked where
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
    """This rank's stage of a sequential model pipelined over ``ranks``.

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
    ) -> None:
        _check_arguments(ranks, device, data_parallel_group, mesh)
        super().__init__()
        rt = runtime.get_runtime()
        self.rank = comm.rank()
        ranks, data_parallel_group = _from_mesh(
            mesh, rt.mesh, ranks, data_parallel_group, self.rank
        )
        self.ranks = _check_ranks(ranks, comm.world_size(), self.rank)
        layers = partition.layers_of(model)
        if balance is None:
            self.balance = partition.balance_by_params(model, len(self.ranks))
        else:
            self.balance = partition.check_balance(balance, len(layers), len(self.ranks))
        self.chunks = _check_chunks(chunks)
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(
                f"loss_reduction={loss_reduction!r} must be 'mean' or 'sum'",
                fix="say how loss_fn reduces over samples ('mean' is torch's default).",
            )
        self.loss_reduction = loss_reduction
        self.stage_index = self.ranks.index(self.rank)
        self.device = resolve_device(device if device else rt.device, "device")
        start = sum(self.balance[: self.stage_index])
        mine = OrderedDict(layers[start : start + self.balance[self.stage_index]])
        for name, layer in mine.items():
            self.add_module(name, layer.to(self.device))
        self.__dict__["stage"] = nn.Sequential(mine)  # the same layers, not registered twice
        self.data_parallel_group = data_parallel_group
        self.require_backward_grad_sync = True
        """False inside ``no_sync()``: ``train_step`` leaves the gradients un-averaged."""
        nccl = rt.backend is not None and "nccl" in rt.backend
        self._link = p2p.Link(self.device if nccl else torch.device("cpu"), rt.timeout, self.rank)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == len(self.ranks) - 1

    def train_step(
        self, x: torch.Tensor | None, target: torch.Tensor | None, loss_fn: LossFn
    ) -> torch.Tensor | None:
        """Forward and backward of one batch; gradients of the batch loss accumulate in ``.grad``.

        ``x`` is read on the first stage and ``target`` on the last (others may pass None).
        Returns the batch loss (detached) on the last stage, None elsewhere. Does not step or
        zero the optimizer. Sync point: the pipeline's ranks (and ``data_parallel_group``).
        """
        inputs, outputs, losses = self._forward_phase(x, target, loss_fn)
        sizes = [out.shape[0] for out in outputs]
        for i in reversed(range(len(outputs))):
            if self.is_last:
                scale = sizes[i] / sum(sizes) if self.loss_reduction == "mean" else 1.0
                (losses[i] * scale).backward()
            else:
                out = outputs[i]
                grad = self._link.recv(out.shape, out.dtype, self._next, f"gradient {i}")
                out.backward(grad.to(self.device))
            if not self.is_first:
                self._link.send(inputs[i].grad, self._prev, f"gradient {i}", None)
        self._link.flush()
        if self.require_backward_grad_sync:
            self._average_gradients()
        if not self.is_last:
            return None
        weights = [s / sum(sizes) if self.loss_reduction == "mean" else 1.0 for s in sizes]
        return sum(w * loss.detach() for w, loss in zip(weights, losses, strict=True))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally: ``train_step`` inside does not average them over
        ``data_parallel_group`` (activations still flow between stages); the next one outside
        averages the sum. What ``rt.accumulate`` uses."""
        return gradient_sync_off(self)

    def forward(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Pipelined forward only (evaluation): the output on the last stage, None elsewhere.

        Sync point: the pipeline's ranks.
        """
        _, outputs, _ = self._forward_phase(x, None, None)
        return torch.cat(outputs, dim=0) if self.is_last else None

    @property
    def _prev(self) -> int:
        return self.ranks[self.stage_index - 1]

    @property
    def _next(self) -> int:
        return self.ranks[self.stage_index + 1]

    def _micro_batches(self, x: torch.Tensor | None) -> list[torch.Tensor]:
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"the first pipeline stage (rank {self.rank}) needs the input batch, got "
                f"{type(x).__name__}",
                fix="pass the batch tensor as x to train_step/forward on the first stage.",
                rank=self.rank,
            )
        x = x.to(self.device)
        return [mb for mb in torch.tensor_split(x, self.chunks, dim=0) if mb.shape[0] > 0] or [x]

    def _forward_phase(self, x, target, loss_fn):
        micro = self._micro_batches(x) if self.is_first else []
        count = len(micro) if self.is_first else None
        inputs, outputs, losses, offset, i = [], [], [], 0, 0
        while count is None or i < count:
            if self.is_first:
                inp = micro[i]
            else:
                sender = f"stage {self.stage_index - 1} (rank {self._prev})"
                head = self._link.recv_header(self._prev, f"activation {i}", sender, (i, count))
                count = head.num_micro_batches
                inp = self._link.recv(head.shape, head.dtype, self._prev, f"activation {i}")
                inp = inp.to(self.device).requires_grad_(inp.is_floating_point())
            out = self.stage(inp)
            if self.is_last and loss_fn is not None:
                losses.append(self._loss(loss_fn, out, target, offset))
                offset += out.shape[0]
            elif not self.is_last:
                head = p2p.Header(i, count, out.dtype, tuple(out.shape))
                self._link.send(out, self._next, f"activation {i}", head)
            inputs.append(inp)
            outputs.append(out)
            i += 1
        self._link.flush()
        return inputs, outputs, losses

    def _loss(self, loss_fn: LossFn, out, target, offset: int) -> torch.Tensor:
        if not isinstance(target, torch.Tensor):
            raise ConfigError(
                f"the last pipeline stage (rank {self.rank}) computes the loss and needs the "
                f"target batch, got {type(target).__name__}",
                fix="pass the targets as target to train_step on the last stage.",
                rank=self.rank,
            )
        return loss_fn(out, target[offset : offset + out.shape[0]].to(out.device))

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
            f"balance={self.balance}, chunks={self.chunks}, device={self.device}"
        )
