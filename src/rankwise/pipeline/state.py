"""Checkpoints of a pipelined model that do not depend on the pipeline: the whole model in one
file, as one process would save it.

``PipelineState(model)`` and ``PipelineOptimState(optimizer, model)`` are the views
``rt.save``/``rt.load`` pass to ``rw.save_checkpoint``/``rw.load_checkpoint`` for a model that
``rt.prepare`` cut into stages (as ``FullState`` does for tensor slices): their ``state_dict``
is a collective over each pipeline group that gathers every stage's state (each stage's own,
consolidated first over its data group by ZeRO), so rank 0 writes the unsplit model's keys
and the unsplit optimizer's state (parameters numbered as in the optimizer given to
``rt.prepare``). Loading hands each stage its part. The file loads into one plain process,
and into a pipeline of any size. Stages pass their parts as ``torch.save`` bytes read back
with ``weights_only=True`` (``rankwise.comm.wire``): nothing a peer sends runs code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoint.state_dict import strip_prefixes
from ..comm import wire
from ..errors import ConfigError
from .model import PipelineModel


def pipeline_in(model: Any) -> PipelineModel | None:
    """The ``PipelineModel`` under ``model``'s wrappers (DDP, ZeRO, compile), if any."""
    inner = model
    while isinstance(inner, nn.Module) and not isinstance(inner, PipelineModel):
        nxt = inner._modules.get("_orig_mod") or inner._modules.get("module")
        inner = nxt if nxt is not inner else None
    return inner if isinstance(inner, PipelineModel) else None


def _stage_state(model: nn.Module, pipe: PipelineModel) -> dict[str, torch.Tensor]:
    """This stage's model state: through the engine when its state dict is a collective
    (ZeRO gathers the data group's shards), else the stage module's own."""
    if getattr(model, "collective_state_dict", False):
        state = strip_prefixes(model.state_dict())
    else:
        state = pipe.module.state_dict()
    return {k: v.detach().cpu() for k, v in state.items()}


class PipelineState(nn.Module):
    """A pipelined model seen whole by ``save_checkpoint``/``load_checkpoint``."""

    collective_state_dict = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.pipe = pipeline_in(model)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The unsplit model's state dict (CPU), on every rank. Sync point: all ranks."""
        parts = wire.all_gather_tensors_state(
            _stage_state(self.model, self.pipe), label="pipeline stages' state",
            group=self.pipe.group,
        )  # fmt: skip
        merged = {k: v for part in parts for k, v in part.items()}
        order = [k for k in self.pipe.full_keys if k in merged]
        return {k: merged[k] for k in order}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """This stage's part of an unsplit model's state. No sync point (ZeRO's own aside)."""
        state = strip_prefixes(dict(state))
        mine = set(self.pipe.module.state_dict())
        missing = sorted(mine - set(state))
        unknown = sorted(set(state) - set(self.pipe.full_keys))
        if strict and (missing or unknown):
            raise ConfigError(
                f"checkpoint does not fit this pipelined {self.pipe.model_class}: missing keys "
                f"{missing[:8]}, unexpected keys {unknown[:8]}",
                fix="load into the same architecture that was saved, or strict=False.",
            )
        local = {k: v for k, v in state.items() if k in mine}
        if getattr(self.model, "collective_state_dict", False):
            return self.model.load_state_dict(local, strict=strict)
        from ..checkpoint import load_model_state  # the usual key and shape checks

        load_model_state(self.pipe.module, local, strict=strict)
        return None


class PipelineOptimState:
    """The optimizer of a pipelined model seen whole: its state numbered as the optimizer
    given to ``rt.prepare`` numbered the whole model's parameters."""

    collective_state_dict = True

    def __init__(self, optimizer: Any, model: nn.Module) -> None:
        self.optimizer = optimizer
        self.pipe = pipeline_in(model)

    def state_dict(self) -> dict[str, Any]:
        """One process's optimizer state, on every rank. Sync point: all ranks."""
        local = self.optimizer.state_dict()  # ZeRO: consolidated over the data group first
        index = self.pipe.optimizer_index
        part = {
            "state": {index[k]: v for k, v in local["state"].items()},
            "param_groups": [
                {**g, "params": [index[k] for k in g["params"]]} for g in local["param_groups"]
            ],
        }
        parts = wire.all_gather_tensors_state(part, label="pipeline optimizer state",
                                              group=self.pipe.group)  # fmt: skip
        state = {k: v for p in parts for k, v in p["state"].items()}
        groups = [dict(g) for g in parts[0]["param_groups"]]
        for g, group in enumerate(groups):
            group["params"] = sorted({i for p in parts for i in p["param_groups"][g]["params"]})
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """This stage's part of one process's optimizer state. No sync point (ZeRO's aside)."""
        local_of = {full: k for k, full in enumerate(self.pipe.optimizer_index)}
        sizes = self.pipe.optimizer_group_sizes
        groups, start = [], 0
        for g, size in enumerate(sizes):
            hyper = {k: v for k, v in state["param_groups"][g].items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + size))})
            start += size
        mine = {local_of[f]: v for f, v in state["state"].items() if f in local_of}
        self.optimizer.load_state_dict({"state": mine, "param_groups": groups})


def pipeline_checkpoint_states(
    kwargs: dict[str, Any], model: nn.Module, optimizer: Any, tensor_parallel: bool
) -> dict[str, Any]:
    """A model ``rt.prepare`` cut into pipeline stages, saved and loaded whole
    (``PipelineState``; stages split by tensor parallelism are not gathered here)."""
    if tensor_parallel:
        raise ConfigError(
            "rt.save/rt.load of a pipeline whose stages are tensor-parallel: the consolidated "
            "checkpoint gathers the pipeline stages but not the tensor slices",
            fix="save each rank's part with rw.save_checkpoint(path_per_rank, model=model), or "
            "use a pipeline x data mesh for consolidated checkpoints.",
        )
    out = dict(kwargs, model=PipelineState(model))
    if optimizer is not None:
        out["optimizer"] = PipelineOptimState(optimizer, model)
    return out
