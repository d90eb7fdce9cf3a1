"""``rt.prepare`` under a pipeline mesh: cut the model into stages, keep this rank's.

``rw.init(mesh={"pipeline": P, ...})`` + ``rt.prepare(model, opt, loader)``: the model becomes
a ``rankwise.pipeline.PipelineModel`` holding this rank's stages (on ``rt.device``), the
optimizer keeps only their parameters (its groups and hyperparameters as they were), and the
strategy's engine (``ddp``, ``zero1``, ``zero2``) then wraps the stage over the mesh's data
group like any model. The loader is split over the data dimension only (every stage of a
pipeline reads the same batches: the first stage its inputs, the last its targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import validate
from ..errors import ConfigError
from ..pipeline import PipelineModel
from ..pipeline.schedules import SCHEDULES
from ..runtime import Runtime


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """``rt.prepare``'s pipeline arguments."""

    schedule: str | None = None
    """``"1f1b"`` (default), ``"gpipe"``, ``"interleaved_1f1b"``, ``"zero_bubble"``."""
    microbatches: int | None = None
    """Micro-batches per batch; default 4 per pipeline stage."""
    stages_per_rank: int | None = None
    """Virtual stages per rank (interleaved: default 2)."""
    loss_fn: Any = None
    """``loss_fn(output, target)`` for a model that returns outputs, not its loss."""

    def __post_init__(self) -> None:
        """Each by type and value, before anything moves (``rankwise.validate``)."""
        where = "rt.prepare()"
        validate.choice("pipeline_schedule", self.schedule, SCHEDULES, where=where, optional=True)
        validate.integer("microbatches", self.microbatches, minimum=1, optional=True, where=where,
                         example=8)  # fmt: skip
        validate.integer("stages_per_rank", self.stages_per_rank, minimum=1, optional=True,
                         where=where, example=2)  # fmt: skip
        if self.loss_fn is not None and not callable(self.loss_fn):
            validate.fail("loss_fn", self.loss_fn, "a function loss_fn(output, target) or None",
                          where=where, fix="pass e.g. loss_fn=torch.nn.functional.cross_entropy.")

    def given(self) -> list[str]:
        names = {"schedule": "pipeline_schedule"}
        return [names.get(k, k) for k, v in vars(self).items() if v is not None]


def seed_scale(rt: Any) -> float:
    """What ``rt.backward`` will multiply the loss's gradient by: the loss scale
    ('fp16-mixed') over ``rt.accumulate``'s division."""
    scaler = rt.loop.scaler
    scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
    return scale / rt.loop.loss_divisor


def pipeline_stages(
    rt: Runtime, model: nn.Module, optimizer: Any, options: PipelineOptions, deferred: Any = None
) -> tuple[nn.Module, Any]:
    """This rank's stages of ``model`` and the optimizer over them, under a pipeline mesh;
    both unchanged otherwise. ``deferred``: the meta-device plan (refused under a pipeline).
    Sync point: all ranks under a pipeline mesh."""
    size = 1 if rt.mesh is None else rt.mesh.sizes["pipeline"]
    if size == 1:
        if options.given():
            raise ConfigError(
                f"rt.prepare got {', '.join(f'{n}=' for n in options.given())} but the mesh has "
                "no pipeline dimension",
                fix='pipeline the model with rw.init(mesh={"pipeline": 2, ...}), or drop them.',
                rank=rt.rank,
            )
        return model, optimizer
    if deferred is not None:
        raise ConfigError(
            f"rt.prepare got a model built on the meta device under a pipeline mesh "
            f"({rt.mesh.describe()}): the stages are cut from a model whose tensors exist",
            fix="build the model on the CPU (without torch.device('meta')) when it is to be "
            "pipelined; meta-device models are prepared under the data and tensor dimensions.",
            rank=rt.rank,
        )
    if rt.strategy_spec.zero_stage == 3:
        raise ConfigError(
            f"strategy={rt.strategy!r} with a pipeline mesh ({rt.mesh.describe()}): ZeRO stage 3 "
            "gathers each block's parameters around its forward and backward, which the "
            "pipeline's split backward passes do not keep in step",
            fix="use strategy='zero2' or 'zero1' (or 'ddp') over the data dimension of a "
            "pipeline; each stage already holds only its own parameters.",
            rank=rt.rank,
        )
    nccl = rt.backend is not None and "nccl" in rt.backend
    stage = PipelineModel(
        model, mesh=rt.mesh, device=rt.device, timeout=rt.timeout, nccl=nccl,
        schedule=options.schedule or "1f1b", microbatches=options.microbatches,
        stages_per_rank=options.stages_per_rank, loss_fn=options.loss_fn,
        scale=lambda: seed_scale(rt),
    )  # fmt: skip
    if optimizer is not None:
        keep_stage_parameters(optimizer, stage)
    return stage, optimizer


def keep_stage_parameters(optimizer: torch.optim.Optimizer, stage: PipelineModel) -> None:
    """Point ``optimizer`` at the stage's parameters only (each group keeps its settings);
    remember each one's place in the whole model's optimizer (``stage.optimizer_index``),
    which a consolidated checkpoint numbers them by."""
    mine = {id(p) for p in stage.module.parameters()}
    index = 0
    stage.optimizer_index, stage.optimizer_group_sizes = [], []
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            if id(p) in mine:
                stage.optimizer_index.append(index)
                kept.append(p)
            index += 1
        group["params"] = kept
        stage.optimizer_group_sizes.append(len(kept))
    for p in [p for p in optimizer.state if id(p) not in mine]:
        del optimizer.state[p]
