"""The sharded engine's optimizer, and state dicts that do not depend on the world size.

``ShardedOptimizer`` wraps the torch optimizer that steps this rank's flat shards: the user's
own optimizer object, pointed at one shard set per parameter group (or what a factory built):
``step()`` steps the shards, then (stages 1/2) all-gathers the updated parameters;
``zero_grad()`` clears the shards and the model's own ``.grad``. Its ``param_groups`` are that
optimizer's, read at every access, so a scheduler and ``g["lr"] = ...`` reach the optimizer
that steps, before and after ``load_state_dict`` (which replaces torch's group dicts).

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

from ...checkpoint.state_dict import strip_prefixes
from ...diagnose import fingerprints
from ...errors import ConfigError
from ..optimizers import group_settings, rebuild_optimizer
from .comm import node_shared

if TYPE_CHECKING:
    from .engine_view import OptimizerFactory, ShardedEngine
    from .shard_unit import FlatUnit

_WHOLE_MODEL = (torch.optim.LBFGS, torch.optim.SparseAdam, torch.optim.Adafactor, torch.optim.Muon)
"""Optimizers whose update is not elementwise over a flat shard: LBFGS line-searches the whole
model, SparseAdam needs sparse gradients, Adafactor factors a matrix's second moment by rows
and columns and Muon orthogonalises a matrix update: both need each parameter's 2-D shape."""


def _refuse_whole_model(cls: type, rank: int) -> None:
    if issubclass(cls, _WHOLE_MODEL):
        raise ConfigError(
            f"{cls.__name__} cannot run sharded: its update is not element by element (LBFGS "
            "needs the whole model, SparseAdam sparse gradients, Adafactor and Muon each "
            "matrix's shape), while each rank holds a flat 1/N slice of the parameters",
            fix="use an optimizer whose state is per parameter element (SGD, Adam, AdamW, "
            f"RMSprop, ...), or strategy='ddp' to keep {cls.__name__} on whole parameters.",
            rank=rank,
        )


def _trained(optimizer: torch.optim.Optimizer) -> bool:
    """State beyond what a constructor sets up (Adagrad's: a zero step and its accumulator)."""
    for entry in optimizer.state.values():
        step = entry.get("step")
        if step is None or float(step) != 0:
            return True
    return False


def optimizer_groups(
    engine: ShardedEngine, optimizer: Any
) -> tuple[list[list[nn.Parameter]], list[int | None]]:
    """The optimizer's groups of model parameters, and the group of each trainable one.

    A factory gets one group over every parameter (the format of ``optimizer_class(model.
    parameters())``). No sync point.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [list(engine._root.parameters())], [0] * len(engine.params)
    _refuse_whole_model(type(optimizer), engine.rank)
    mine = {id(p) for p in engine._root.parameters()}
    groups = [list(g["params"]) for g in optimizer.param_groups]
    if any(id(p) not in mine for g in groups for p in g):
        raise ConfigError(
            "the optimizer holds tensors that are not parameters of the wrapped model",
            fix="build it over the model you wrap: torch.optim.AdamW(model.parameters(), ...).",
            rank=engine.rank,
        )
    if _trained(optimizer):
        raise ConfigError(
            f"the optimizer already holds state for {len(optimizer.state)} parameters; the "
            "sharded engine re-points it at this rank's shards and would drop that state",
            fix="wrap (rt.prepare) before the first step, and restore a checkpoint afterwards "
            "with rw.load_checkpoint(path, model=model, optimizer=optimizer).",
            rank=engine.rank,
        )
    group_of = {id(p): g for g, params in enumerate(groups) for p in params}
    return groups, [group_of.get(id(p)) for p in engine.params]


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
    _refuse_whole_model(type(inner), rank)
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


def adopt_shards(
    engine: ShardedEngine, optimizer: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """Point the user's ``optimizer`` at this rank's shards, group by group; return it.

    The groups and (constructor-made) state come from the same class rebuilt over the shards
    (``parallel/optimizers.py``), so each group keeps its settings and the object the user
    holds, with its hooks and the schedulers built on it, is the one that steps.
    """
    per_group: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for unit, group in zip(engine.units, engine.unit_group, strict=True):
        if group is not None:
            per_group[group].append(unit.shard)
    fresh = rebuild_optimizer(optimizer, per_group)
    optimizer.param_groups = fresh.param_groups
    optimizer.state = fresh.state
    return optimizer


class ShardedOptimizer(torch.optim.Optimizer):
    """The optimizer of a :class:`ShardedDataParallel`: ``step``, ``zero_grad``, state dicts.

    ``param_groups``, ``state`` and ``defaults`` are the stepping optimizer's (``.inner``: the
    user's own object), read at each access: schedulers built on either object work, and so
    does ``for g in opt.param_groups: g["lr"] = ...``, also after ``load_state_dict``.
    Sync point: all ranks, in ``step()``, ``state_dict()``.
    """

    collective_state_dict = True

    def __init__(self, engine: ShardedEngine, optimizer: Any) -> None:
        # Not Optimizer.__init__: the groups and state are the inner optimizer's own.
        if isinstance(optimizer, torch.optim.Optimizer):
            self.inner = adopt_shards(engine, optimizer)
        else:
            self.inner = build_inner(optimizer, [u.shard for u in engine.units], engine.rank)
        self.engine = engine
        self._stepping = False
        self.inner.register_step_pre_hook(self._refuse_direct_step)

    def _refuse_direct_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Stepping the inner (the user's own) object would skip the all-gather of the updated
        # slices: the replicas would silently drift apart.
        if not self._stepping:
            raise ConfigError(
                f"{type(optimizer).__name__}.step() was called on the optimizer given to "
                "rt.prepare; under ZeRO it steps this rank's shards, and the optimizer "
                "rt.prepare returned must drive it (it then shares the updated slices)",
                fix="use the returned one: model, opt = rt.prepare(model, opt); opt.step(); "
                "opt.zero_grad() (schedulers and g['lr'] writes on either object are fine).",
                rank=self.engine.rank,
            )

    def __getattr__(self, name: str) -> Any:
        # Only for what this class lacks (the hook registries Optimizer's methods use): hooks
        # registered here land on the inner optimizer, whose step this one calls.
        if name in ("inner", "engine"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError(
            "add_param_group on a sharded optimizer: the shard layout is fixed when the model "
            "is wrapped",
            fix="build the optimizer with every parameter group before rt.prepare.",
            rank=self.engine.rank,
        )

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.engine.stage}, {self.inner!r})"

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        node_shared.before_write(self.engine)  # every rank has read what it is about to update
        self._stepping = True
        try:
            self.inner.step()
        finally:
            self._stepping = False
        self.engine._after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for unit in self.engine.units:  # shards outside the optimizer's groups too
            if set_to_none:
                unit.shard.grad = None
            elif unit.shard.grad is not None:
                unit.shard.grad.zero_()
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


def _positions(engine: ShardedEngine) -> tuple[dict[int, int], list[list[int]]]:
    """id(model parameter) -> its index in one process's optimizer state, and each group's
    indices (torch numbers parameters group after group, in each group's order)."""
    position: dict[int, int] = {}
    indices: list[list[int]] = []
    for params in engine.group_params:
        indices.append([position.setdefault(id(p), len(position)) for p in params])
    return position, indices


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
    position, indices = _positions(engine)
    state: dict[int, dict[str, Any]] = {}
    for unit, group in zip(engine.units, engine.unit_group, strict=True):
        if group is None:
            continue
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
    groups = [
        {**group_settings(g), "params": ids}
        for g, ids in zip(inner.param_groups, indices, strict=True)
    ]
    return {"state": state, "param_groups": groups}


def _index_map(engine: ShardedEngine, saved: dict[str, Any]) -> dict[int, int]:
    """id(parameter) -> its index in the saved state (group by group; or, for one group,
    saved over every parameter or over the trainable ones only)."""
    groups = saved.get("param_groups", [])
    ours = engine.group_params
    sizes = [len(g["params"]) for g in groups]
    if sizes == [len(params) for params in ours]:
        pairs = zip(groups, ours, strict=True)
        return {id(p): i for g, params in pairs for p, i in zip(params, g["params"], strict=True)}
    if len(groups) == 1 == len(ours) and sizes[0] == len(engine.params):
        return {id(p): i for p, i in zip(engine.params, groups[0]["params"], strict=True)}
    raise ConfigError(
        f"the optimizer state holds parameter groups of sizes {sizes}, but this optimizer's "
        f"groups hold {[len(params) for params in ours]} parameters",
        fix="load a checkpoint of the same model, saved from an optimizer with the same "
        "parameter groups.",
        rank=engine.rank,
    )


def load_consolidated_optimizer_state(
    engine: ShardedEngine, inner: Any, saved: dict[str, Any]
) -> None:
    where = _index_map(engine, saved)
    saved_state = {int(k): v for k, v in saved.get("state", {}).items()}
    shards = [p for g in inner.param_groups for p in g["params"]]
    number = {id(shard): i for i, shard in enumerate(shards)}
    shard_state: dict[int, dict[str, Any]] = {}
    for unit, group in zip(engine.units, engine.unit_group, strict=True):
        entries = [saved_state.get(where[id(p)]) for p in unit.params]
        present = [e for e in entries if e]
        if group is None or not present:
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
        shard_state[number[id(unit.shard)]] = out
    groups = [
        {**group_settings(saved_group), "params": [number[id(s)] for s in g["params"]]}
        for saved_group, g in zip(saved["param_groups"], inner.param_groups, strict=True)
    ]
    inner.load_state_dict({"state": shard_state, "param_groups": groups})


# -- the model's state --------------------------------------------------------------------


def full_model_state(engine: ShardedEngine) -> dict[str, Any]:
    """The bare module's full state. Sync point: all ranks (stage 3: the root's state-dict
    hook gathers each unit in turn and copies it, ``stage3.Stage3Hooks._full_state``)."""
    state = engine._root.state_dict()
    return state if engine.stage == 3 else strip_prefixes(state)


def load_full_model_state(engine: ShardedEngine, state: Any, strict: bool) -> Any:
    """Every rank loads the full state, then keeps its slices (no communication)."""
    from ...checkpoint import load_model_state

    node_shared.before_write(engine)  # stage 3 on one machine: nobody reads them meanwhile
    loaded = {}
    for unit in engine.units:  # stage 3: storage for the full values, filled by the load
        if unit.node is not None:  # a private copy: each rank keeps only its own chunk
            loaded[unit.number] = unit.full.clone()
            unit.view_params(loaded[unit.number])
        elif not unit.gathered:
            unit.full.untyped_storage().resize_(unit._nbytes)
            unit.gathered = True
    load_model_state(engine._root, state, strict=strict)
    if engine.stage3 is not None:  # stages 1/2: the shards are views of what was just loaded
        with torch.no_grad():
            for unit in engine.units:
                unit.shard.copy_(loaded.get(unit.number, unit.full)[unit.lo : unit.hi])
                if unit.node is not None:
                    unit.view_params(unit.full)
        engine.stage3.free_all()

