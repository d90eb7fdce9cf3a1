"""The sharded engine's optimizer, and state dicts that do not depend on the world size.

``ShardedOptimizer`` wraps the torch optimizer the user's factory built over this rank's flat
shards: ``step()`` steps the shards, then (stages 1/2) all-gathers the updated parameters;
``zero_grad()`` clears the shards and the model's own ``.grad``.

Its ``state_dict()`` is *consolidated*: the format torch's optimizer would produce on one
process for ``optimizer_class(model.parameters())`` — one state entry per model parameter,
shaped like it — so a checkpoint saved by N ranks under stage s loads into a plain optimizer,
into DDP, or into a sharded run at M ranks under another stage. Building it gathers every
state tensor (a collective); loading takes each rank's slice without communication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...diagnose import fingerprints
from ...errors import ConfigError
from ...state_dict import strip_prefixes

if TYPE_CHECKING:
    from .engine_view import OptimizerFactory, ShardedEngine
    from .shard_unit import FlatUnit

_WHOLE_MODEL = (torch.optim.LBFGS, torch.optim.SparseAdam)
"""Optimizers whose update is not elementwise over a flat shard (or that need sparse grads)."""


def build_inner(
    factory: OptimizerFactory, shards: list[nn.Parameter], rank: int
) -> torch.optim.Optimizer:
    inner = factory(list(shards))
    if not isinstance(inner, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer_factory returned {type(inner).__name__}, not a torch.optim.Optimizer",
            fix="pass a function of the parameter list: lambda ps: torch.optim.AdamW(ps, lr=1e-3).",
            rank=rank,
        )
    if isinstance(inner, _WHOLE_MODEL):
        raise ConfigError(
            f"{type(inner).__name__} cannot run sharded: its update needs the whole model "
            "(LBFGS keeps a history of full flat gradients and line-searches over all "
            "parameters), while each rank holds 1/N of them",
            fix="use an optimizer whose state is per parameter element (SGD, Adam, AdamW, "
            "RMSprop, ...), or strategy='ddp' to keep LBFGS on replicated parameters.",
            rank=rank,
        )
    given = {id(p) for g in inner.param_groups for p in g["params"]}
    if given != {id(p) for p in shards}:
        raise ConfigError(
            "optimizer_factory must build the optimizer over the parameter list it receives "
            "(this rank's flat shards), not over the model's parameters",
            fix="write it as lambda params: torch.optim.AdamW(params, lr=...).",
            rank=rank,
        )
    if len(inner.param_groups) != 1:
        raise ConfigError(
            f"the optimizer has {len(inner.param_groups)} parameter groups; the sharded engine "
            "flattens all parameters into shards that share one group",
            fix="use one set of hyperparameters (one parameter group) with ZeRO.",
            rank=rank,
        )
    return inner


class ShardedOptimizer(torch.optim.Optimizer):
    """The optimizer of a :class:`ShardedDataParallel`: ``step``, ``zero_grad``, state dicts.

    Its ``param_groups`` are the inner optimizer's (learning-rate schedulers work on it).
    Sync point: all ranks, in ``step()``, ``state_dict()``.
    """

    collective_state_dict = True

    def __init__(self, engine: ShardedEngine, factory: OptimizerFactory) -> None:
        shards = [u.shard for u in engine.units]
        inner = build_inner(factory, shards, engine.rank)
        super().__init__(inner.param_groups, inner.defaults)
        self.state = inner.state
        self.inner = inner
        self.engine = engine

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner.step()
        self.engine._after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.engine.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """Consolidated state (one process's format). Sync point: all ranks."""
        return consolidated_optimizer_state(self.engine, self.inner)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (saved by any world size, stage, DDP or one process)."""
        load_consolidated_optimizer_state(self.engine, self.inner, state_dict)


# -- consolidation ------------------------------------------------------------------------


def _all_params(engine: ShardedEngine) -> list[nn.Parameter]:
    return list(engine.module.parameters())  # unique, in the order torch's optimizer sees them


def _gather_full(unit: FlatUnit, shard: torch.Tensor) -> torch.Tensor:
    full = torch.empty(unit.spec.padded, dtype=shard.dtype, device=shard.device)
    if not unit.communicates:
        return shard.detach().clone()
    with fingerprints.collective(
        "all_gather", shard, label=f"optimizer state of unit {unit.number}", group=unit.group
    ):
        dist.all_gather_single(full, shard.detach().contiguous(), group=unit.group)
    return full


def consolidated_optimizer_state(engine: ShardedEngine, inner: Any) -> dict[str, Any]:
    position = {id(p): i for i, p in enumerate(_all_params(engine))}
    state: dict[int, dict[str, Any]] = {}
    for unit in engine.units:
        mine = inner.state.get(unit.shard, {})
        for key in sorted(mine):
            value = mine[key]
            is_flat = isinstance(value, torch.Tensor) and value.shape == unit.shard.shape
            full = _gather_full(unit, value) if is_flat else None
            for p, off, n in zip(unit.params, unit.spec.offsets, unit.spec.numels, strict=True):
                slot = state.setdefault(position[id(p)], {})
                if full is not None:
                    slot[key] = full[off : off + n].view(p.shape).clone()
                else:
                    slot[key] = value.clone() if isinstance(value, torch.Tensor) else value
    group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
    group["params"] = list(range(len(position)))
    return {"state": state, "param_groups": [group]}


def _index_map(engine: ShardedEngine, saved: dict[str, Any]) -> dict[int, int]:
    """id(parameter) -> its index in the saved state (saved over all, or trainable only)."""
    everything, trainable = _all_params(engine), engine.params
    groups = saved.get("param_groups", [])
    count = sum(len(g["params"]) for g in groups)
    indices = [i for g in groups for i in g["params"]]
    for candidates in (everything, trainable):
        if count == len(candidates):
            return {id(p): indices[j] for j, p in enumerate(candidates)}
    raise ConfigError(
        f"the optimizer state holds {count} parameters, but the model has {len(everything)} "
        f"({len(trainable)} trainable)",
        fix="load a checkpoint of the same model, saved from an optimizer over "
        "model.parameters().",
        rank=engine.rank,
    )


def load_consolidated_optimizer_state(
    engine: ShardedEngine, inner: Any, saved: dict[str, Any]
) -> None:
    where = _index_map(engine, saved)
    saved_state = {int(k): v for k, v in saved.get("state", {}).items()}
    shard_state: dict[int, dict[str, Any]] = {}
    for u, unit in enumerate(engine.units):
        entries = [saved_state.get(where[id(p)]) for p in unit.params]
        present = [e for e in entries if e]
        if not present:
            continue
        out: dict[str, Any] = {}
        for key, sample in present[0].items():
            if not (isinstance(sample, torch.Tensor) and sample.dim() > 0):
                out[key] = sample  # a scalar (Adam's step count): the same for every element
                continue
            full = torch.zeros(unit.spec.padded, dtype=sample.dtype, device=unit.device)
            for e, off, n in zip(entries, unit.spec.offsets, unit.spec.numels, strict=True):
                if e and key in e:
                    full[off : off + n].copy_(e[key].reshape(-1))
            out[key] = full[unit.lo : unit.hi].clone()
        shard_state[u] = out
    group = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
    group["params"] = list(range(len(engine.units)))
    inner.load_state_dict({"state": shard_state, "param_groups": [group]})


# -- the model's state --------------------------------------------------------------------


def full_model_state(engine: ShardedEngine) -> dict[str, Any]:
    """Sync point: all ranks (stage 3 gathers every unit, copies, frees again)."""
    if engine.stage < 3:
        return strip_prefixes(engine.module.state_dict())
    for unit in engine.units:
        unit.gather()
    for unit in engine.units:
        unit.wait_gathered()
    try:
        state = engine.module.state_dict()
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    finally:
        engine.stage3.free_all()


def load_full_model_state(engine: ShardedEngine, state: Any, strict: bool) -> Any:
    """Every rank loads the full state, then keeps its slices (no communication)."""
    from ...checkpoint import load_model_state

    for unit in engine.units:  # stage 3: storage for the full values, filled by the load
        if not unit.gathered:
            unit.full.untyped_storage().resize_(unit._nbytes)
            unit.gathered = True
    load_model_state(engine.module, state, strict=strict)
    if engine.stage3 is not None:  # stages 1/2: the shards are views of what was just loaded
        with torch.no_grad():
            for unit in engine.units:
                unit.shard.copy_(unit.full[unit.lo : unit.hi])
        engine.stage3.free_all()
