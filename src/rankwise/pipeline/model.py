"""``PipelineModel``: what ``rt.prepare`` returns on each rank under a pipeline mesh.

The model is cut into ``pipeline x stages_per_rank`` stages (``blocks.py``) and this rank keeps
its own. Calling it with a batch and its targets (``model(x, y)``, as a model that computes its
own loss is called; ``rt.prepare(..., loss_fn=...)`` for one that returns outputs) runs the
whole step on the schedule: every micro-batch's forward and backward, interleaved as the
schedule says, on every rank of the pipeline. It returns what the model returns, with the batch
loss on every rank (the last stage sends it to the others) and the other outputs left out
(``None``: keeping every micro-batch's logits would cost the memory the schedule saves).

Why the backward runs inside the call: 1F1B starts micro-batch 0's backward before
micro-batch 4's forward, so the call must know the loss; a loop's ``loss.backward()`` comes
too late. The gradients are held back until the loop's ``rt.backward(loss)`` (or
``loss.backward()``): the returned loss's backward adds them to ``.grad`` in one go, scaled by
what was asked (the loss scale, ``rt.accumulate``'s division), and sums the tied weights'
gradients between the stages that hold them (``tied.py``). So a data-parallel engine around
this module (``rt.prepare``'s DDP or ZeRO over the mesh's data group) sees one ordinary
backward per step, and a loss that is never backpropagated (evaluation) changes no gradient.
Under ``torch.no_grad()`` or ``model.eval()`` the call runs the forwards only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from . import blocks, schedules
from .execution import p2p, step
from .execution.executor import Executor, StepResult
from .execution.weight_pass import WeightPass
from .outputs import Outputs, merge, rebuild, split_inputs, structure_of
from .tied import TiedWeights, shared_across


class PipelineModel(nn.Module):
    """This rank's stages of ``model`` on the pipeline groups of ``mesh`` (``rt.prepare``).

    ``schedule``/``stages_per_rank``: as ``rw.DistributedPipeline``; ``microbatches``: per
    batch (a smaller batch runs in fewer); ``loss_fn(output, target)``: for a model that does
    not compute its loss (then ``model(x, y)``: the last argument is the target); ``scale()``:
    what the loop will multiply the loss's gradient by (the session's loss scale over its
    accumulation steps). Sync point (construction): every rank of the job.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mesh: Any,
        device: torch.device,
        timeout: Any,
        nccl: bool = False,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        scale: Callable[[], float] = lambda: 1.0,
    ) -> None:
        super().__init__()
        self.ranks, self.position = mesh.ranks("pipeline"), mesh.coord("pipeline")
        self.stage_index = self.position  # the name DistributedPipeline's readers know
        p = len(self.ranks)
        self.schedule_name = schedule
        self.stages_per_rank = schedules.make(schedule, p, 1, stages_per_rank).stages_per_rank
        self.microbatches = _check_microbatches(microbatches, p)
        self.loss_fn, self.scale, self.device = loss_fn, scale, device
        self.plan = blocks.plan(model, p * self.stages_per_rank)
        self.group = mesh.group("pipeline")
        self.full_keys = list(model.state_dict())
        """The unsplit model's state-dict keys, in order (a consolidated checkpoint's)."""
        self.model_class = type(model).__name__
        self.optimizer_index: list[int] = []
        """The optimizer's parameters (in its order on this stage) numbered as in the
        optimizer over the whole model that ``rt.prepare`` was given."""
        self.optimizer_group_sizes: list[int] = []
        self.stages = [self.position + k * p for k in range(self.stages_per_rank)]
        sets = shared_across(_owners(model, self.plan, p), p)
        by_id = {id(q): q for q in model.parameters()}
        # Reached through the model too (it replaced the blocks): not registered twice.
        self.__dict__["runner"] = blocks.localize(model, self.plan, self.stages, device)
        self.module = model.to(device)
        mine = {id(q) for q in self.module.parameters()}
        tied = [(pos, [by_id[i] for i in ids]) for pos, ids in sets if self.position in pos]
        self.tied = TiedWeights(mesh.all_groups("pipeline"), self.ranks,
                                [(pos, [q for q in qs if id(q) in mine]) for pos, qs in tied])  # fmt: skip
        self._params = {s: self._stage_params(s) for s in self.stages}
        self._link = p2p.Link(device if nccl else torch.device("cpu"), timeout, mesh.rank)
        self._weight_pass: WeightPass | None = None
        self.last_step: StepResult | None = None
        """What the last call ran on this rank (actions with times, waits)."""

    @property
    def is_last(self) -> bool:
        return self.position == len(self.ranks) - 1

    def _stage_params(self, stage: int) -> list[nn.Parameter]:
        last = self.plan.num_stages - 1
        names = [f"{self.plan.container}.{b}" if self.plan.container else b
                 for b in self.plan.blocks_of(stage)]  # fmt: skip
        names += list(self.plan.pre) if stage == 0 else []
        names += list(self.plan.post) if stage == last else []
        found = {id(q): q for n in names for q in self.module.get_submodule(n).parameters()}
        return list(found.values())  # every one: which train is read at each backward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One batch through every stage: a training step (forward and backward of every
        micro-batch, gradients held for ``loss.backward()``) with grad mode on and the module
        in training mode, else the forwards only. Sync point: the pipeline's ranks."""
        train = torch.is_grad_enabled() and self.training
        inputs = split_inputs(args, kwargs, self.microbatches, with_target=self.loss_fn is not None)
        weights = step.loss_weights(inputs.sizes, "mean")
        expected = self.scale() if train else 1.0
        sched = step.schedule_for(self.schedule_name, len(self.ranks), len(inputs.sizes),
                                  self.stages_per_rank)  # fmt: skip
        stages = _ModelStages(self, inputs, train)
        executor = Executor(
            sched, self.position, stages,
            step.ProcessTransport(self._link, self.ranks, sched.micro_batches),
            seed=lambda i: expected * weights[i],
            weight_pass=self._weights_for(sched) if train else None,
        )  # fmt: skip
        self.last_step = result = executor.run(forward_only=not train)
        if train:
            loss = step.batch_loss(result.losses, weights) if self.is_last else None
            loss, shape = self._share(loss, stages.structure)
            return rebuild(shape, self._held_back(loss, result, expected))
        out = merge([result.outputs[i] for i in sorted(result.outputs)], weights)
        loss, shape = self._share(_eval_loss(out), structure_of(out, train=False))
        return out if self.is_last else rebuild(shape, loss)

    def _share(self, loss: torch.Tensor | None, shape: Outputs | None):
        """The batch loss and the output's shape, from the last stage to every stage."""
        loss, shape = step.share_loss_and_shape(self._link, self.ranks, self.position, loss, shape)
        return (None if loss is None else loss.to(self.device)), shape

    def _held_back(self, loss: torch.Tensor, result: StepResult, expected: float) -> torch.Tensor:
        params = [q for q in self.module.parameters() if q.requires_grad]
        held = _HeldGrads(params, result.grads, expected, self.tied)
        anchor = params if params else [torch.zeros((), requires_grad=True)]
        return _StepLoss.apply(loss.detach(), held, *anchor)

    def _weights_for(self, sched: schedules.Schedule) -> WeightPass | None:
        if sched.split_backward and self._weight_pass is None:
            self._weight_pass = WeightPass(self.module.modules())
        return self._weight_pass if sched.split_backward else None

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients count towards the model's norm on this rank (a
        tied weight counts on its lowest stage only)."""
        return [q for q in self.module.parameters() if self.tied.owned_here(q)]

    def extra_repr(self) -> str:
        return (
            f"stages={self.stages} of {self.plan.num_stages}, ranks={self.ranks}, "
            f"schedule={self.schedule_name!r}, microbatches={self.microbatches}"
        )


class _HeldGrads:
    """A step's gradients, until the loss's backward adds them to ``.grad``."""

    def __init__(self, params, grads, expected: float, tied: TiedWeights) -> None:
        self.params, self.grads, self.expected, self.tied = params, grads, expected, tied
        self.released = False

    def release(self, grad_out: torch.Tensor) -> list[torch.Tensor | None]:
        if self.released:
            raise ConfigError(
                "the pipeline loss was backpropagated twice; its step's gradients were "
                "already added",
                fix="call rt.backward(loss) once per model(x, y) call.",
            )
        self.released = True
        self.tied.sum_grads(self.grads)
        factor = float(grad_out) / self.expected if self.expected else 1.0
        out = []
        for q in self.params:
            g = self.grads.pop(id(q), None)
            out.append(g if g is None or factor == 1.0 else g * factor)
        return out


class _StepLoss(torch.autograd.Function):
    """The batch loss; its backward hands each parameter its held-back gradient."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, held: _HeldGrads, *params: torch.Tensor):
        ctx.held = held
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grads = ctx.held.release(grad_out)
        ctx.held = None
        return (None, None, *grads)


class _ModelStages:
    """The executor's view of a ``PipelineModel`` rank."""

    def __init__(self, pipe: PipelineModel, inputs: Any, train: bool) -> None:
        self.pipe, self.inputs, self.train = pipe, inputs, train
        self.structure: Outputs | None = None

    def first_input(self, micro_batch: int) -> Any:
        return micro_batch

    def run(self, stage: int, micro_batch: int, x: Any) -> Any:
        pipe, runner = self.pipe, self.pipe.runner
        last = pipe.plan.num_stages - 1
        args, kwargs = self.inputs.args[micro_batch], self.inputs.kwargs[micro_batch]
        if runner is None:  # a plain nn.Sequential: its layers in order
            x = args[0] if stage == 0 else x
            for name in pipe.plan.blocks_of(stage):
                x = pipe.module._modules[name](x)
            return x
        if stage == 0:
            x = _until_blocks(pipe.module, runner, args, kwargs)
        x = runner.run(stage, x.to(pipe.device))
        if stage != last:
            return x
        return _after_blocks(pipe.module, runner, x, args, kwargs)

    def loss(self, micro_batch: int, output: Any) -> torch.Tensor:
        if self.pipe.loss_fn is not None:
            target = self.inputs.targets[micro_batch]
            output = self.pipe.loss_fn(output, target)
        shape = structure_of(output, train=True)
        self.structure = self.structure or shape
        return output if shape.kind == 0 else output[shape.loss_index]

    def parameters_of(self, stage: int) -> list[nn.Parameter]:
        # now, not at rt.prepare: a script may freeze or unfreeze layers between steps
        return [q for q in self.pipe._params[stage] if q.requires_grad]


def _until_blocks(model: nn.Module, runner: blocks.StageBlocks, args, kwargs) -> torch.Tensor:
    runner.mode = "pre"
    try:
        model(*args, **kwargs)
    except blocks.AtBlocks as stop:
        return stop.x
    finally:
        runner.mode = None
    raise ConfigError(
        f"{type(model).__name__}.forward returned without calling its blocks",
        fix="call the blocks in forward: for block in self.blocks: x = block(x).",
    )


def _after_blocks(model: nn.Module, runner: blocks.StageBlocks, x, args, kwargs) -> Any:
    runner.mode, runner.inject, runner.calls = "post", x, 0
    try:
        out = model(*args, **kwargs)
    finally:
        runner.mode, runner.inject = None, None
    if runner.calls != 1:
        raise ConfigError(
            f"{type(model).__name__}.forward called its blocks {runner.calls} times; a pipeline "
            "runs them once per forward",
            fix="call each block once, in order: for block in self.blocks: x = block(x).",
        )
    return out


def _eval_loss(out: Any) -> torch.Tensor | None:
    shape = structure_of(out, train=False) if out is not None else None
    if shape is None or shape.loss_index < 0:
        return None
    return out if shape.kind == 0 else out[shape.loss_index]


def _owners(model: nn.Module, plan: blocks.SplitPlan, ranks: int) -> dict[int, set[int]]:
    """id(parameter) -> the pipeline positions whose stages use it."""
    owners: dict[int, set[int]] = {}
    last = plan.num_stages - 1
    for s in range(plan.num_stages):
        names = [f"{plan.container}.{b}" if plan.container else b for b in plan.blocks_of(s)]
        names += list(plan.pre) if s == 0 else []
        names += list(plan.post) if s == last else []
        for name in names:
            for q in model.get_submodule(name).parameters():
                owners.setdefault(id(q), set()).add(s % ranks)
    return owners


def _check_microbatches(microbatches: int | None, ranks: int) -> int:
    if microbatches is None:
        return 4 * ranks
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(
            f"microbatches={microbatches!r} must be an integer >= 1",
            fix=f"pass e.g. microbatches={4 * ranks} (about 4 per pipeline stage keeps the "
            "bubble small), or leave it out for that default.",
        )
    return microbatches
