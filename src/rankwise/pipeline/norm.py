"""What ``rt.clip_grad_norm_`` needs to know of a pipeline: whether the model is one, over how
many ranks, which parameters count in the norm here (a tied weight once), and where it cannot
compute the global norm."""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from .distributed import DistributedPipeline
from .state import pipeline_in


def is_pipeline(model: nn.Module) -> bool:
    return isinstance(model, DistributedPipeline) or pipeline_in(model) is not None


def pipeline_size(model: nn.Module) -> int:
    pipe = model if isinstance(model, DistributedPipeline) else pipeline_in(model)
    return len(pipe.ranks)


def counted(model: nn.Module, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters whose gradients count in the norm here: a weight tied between two
    pipeline stages counts on the first only."""
    pipe = pipeline_in(model)
    if pipe is None:
        return params
    counted = {id(p) for p in pipe.norm_parameters()}
    return [p for p in params if id(p) in counted]


def refuse_sharded_pipeline(model: nn.Module) -> None:
    if pipeline_in(model) is not None:
        raise ConfigError(
            "rt.clip_grad_norm_ on a pipeline whose stages are sharded by ZeRO: each stage's "
            "engine knows its own shards' norm, not the other stages'",
            fix="use strategy='ddp' over the data dimension of a pipeline to clip by the global "
            "norm, or rt.clip_grad_value_.",
        )
