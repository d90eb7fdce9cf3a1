"""Deferred initialisation: a model built under ``with torch.device("meta"):`` gets real
tensors only where this rank keeps them, one module at a time (docs/zero.md, "Models larger
than one process").

- ``modules``: one module's tensors allocated and initialised in place (``reset_parameters()``
  or the user's ``init(module)``), tied weights and tensor-parallel pieces included;
- ``rng``: every rank draws from the same random state (rank 0's; or, in exact mode, checked
  equal and advanced as an eager build).

The engines decide where each initialised tensor goes: ``materialize`` keeps it whole on the
device (single, dp, ddp); the sharded engine copies this rank's slice into its flat shards and
frees the rest (``parallel/zero/build.py``).

**Order** (``order``): ``model.apply``'s, children before their parent (Hugging Face's
``post_init`` walks the same way), so a parent's initialisation that sets a child's tensor wins
as in an eager build; a tensor is final once the last module that writes it has run. When the
model's eager constructor draws its random numbers in that same order — every module
initialising its own tensors as it is built (a parent's ``reset_parameters()`` at the end of
its ``__init__``), nothing else drawing — and every rank holds the same CPU generator state, the
*exact* mode reproduces an eager CPU build bit for bit. A model that initialises again in a
second pass (``_init_weights``, ``post_init``) cannot be reproduced so: ``plan`` warns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ConfigError, warn_user
from ..optimizers import rebuild_optimizer
from . import order
from .modules import Init, check_set, full_module, has_meta, init_module, make_real, own_tensors
from .rng import agreed

__all__ = [
    "DeferredInit",
    "Init",
    "agreed",
    "any_meta",
    "full_module",
    "has_meta",
    "materialize",
    "meta_modules",
    "own_tensors",
    "plan",
    "refresh_optimizer",
    "to_device",
    "walk",
]


@dataclass(frozen=True, kw_only=True)
class DeferredInit:
    """How a meta-built model is initialised."""

    init: Init | None = None
    """``init(module)`` as ``model.apply(init)`` would call it (children first) for every
    module with meta tensors at or below it, instead of each ``reset_parameters()``."""
    exact: bool = False
    """Build on the CPU from a random state every rank already shares (checked), advancing it
    as an eager build would: values equal to an eager CPU build at the same seed."""

    def __post_init__(self) -> None:
        if self.init is not None and not callable(self.init):
            raise ConfigError(
                f"init={self.init!r} is not callable",
                fix="pass a function init(module) that sets the module's own parameters and "
                "buffers, or leave init out to call each module's reset_parameters().",
            )
        if not isinstance(self.exact, bool):
            raise ConfigError(f"exact_init={self.exact!r} is not a bool",
                              fix="pass exact_init=True or False.")  # fmt: skip

    def build_device(self, device: torch.device) -> torch.device:
        """Where modules are initialised: the CPU in exact mode (an eager CPU build's
        generator), else the device they end on."""
        return torch.device("cpu") if self.exact else device


def any_meta(model: nn.Module) -> bool:
    return any(has_meta(m) for m in model.modules())


def plan(model: nn.Module, init: Init | None, exact_init: bool) -> DeferredInit | None:
    """The ``DeferredInit`` for ``model``, or None for a model with no meta tensor (then
    ``init``/``exact_init`` are refused: there is nothing for them to initialise)."""
    how = DeferredInit(init=init, exact=exact_init)
    if any_meta(model):
        _warn_second_pass(model, how)
        return how
    if init is not None or exact_init:
        given = "init=" if init is not None else "exact_init=True"
        raise ConfigError(
            f"{given} was given, but the model has no tensor on the meta device: it is "
            "initialised already",
            fix="build the model under `with torch.device('meta'):` to initialise it at "
            f"prepare, or drop {given}.",
        )
    return None


def _warn_second_pass(model: nn.Module, how: DeferredInit) -> None:
    """A model whose constructor initialises again after building its layers
    (``self.apply(self._init_weights)``, Hugging Face's ``post_init``): by default that pass is
    skipped, and no mode reproduces its numbers. Said, not refused."""
    if not callable(getattr(model, "_init_weights", None)):
        return
    cls = type(model).__name__
    if how.init is None:
        warn_user(
            f"{cls} has _init_weights(), a second initialisation pass its constructor runs "
            "after building the layers; rt.prepare calls each module's reset_parameters() "
            "instead, so that pass is skipped and the values differ from an eager build's. "
            "Fix: rt.prepare(model, optimizer, init=model._init_weights)."
        )
    if how.exact:
        warn_user(
            f"exact_init=True cannot reproduce an eager build of {cls}: its constructor "
            "initialises each layer, then _init_weights() draws again; here each module is "
            "initialised once, so the values follow the eager build's distributions, not its "
            "numbers. Fix: give the layers reset_parameters() that set their final values "
            "(as rankwise.models.GPT does), or leave exact_init out."
        )


def meta_modules(model: nn.Module, init: Init | None = None) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every module to initialise, in ``model.apply``'s order (children
    first), listed before any is touched (``order.steps``)."""
    return order.steps(model, init)


Built = tuple[nn.Module, list[torch.Tensor]]
"""A module just initialised, and the tensors final after it (the same objects): its own, or
a descendant's it was the last to write."""


def walk(model: nn.Module, how: DeferredInit, device: torch.device) -> Iterator[Built]:
    """Initialise the meta modules one by one on ``how.build_device(device)`` in
    ``model.apply``'s order; yields each module with the tensors that became final (no later
    module writes them: see ``order``). No sync point."""
    build = how.build_device(device)
    steps = order.steps(model, how.init)
    found = order.schedule(steps, how.init, build)
    final, early = order.released_at(found), order.early_at(found, steps)
    done: set[int] = set()
    made: set[int] = set()
    owners: dict[int, tuple[str, nn.Module, str, str]] = {}
    for i, (path, module) in enumerate(steps):
        for t in early.get(i, []):
            make_real(t, build)
            made.add(id(t))
        for kind, name, t in init_module(module, path, how.init, build, done, made):
            owners.setdefault(id(t), (path, module, kind, name))
        ready = [t for t in final.get(i, []) if not t.is_meta]
        for t in ready:
            p, m, kind, name = owners.get(id(t), (path, module, "tensor", "?"))
            check_set(m, p, [(kind, name, t)], how.init)
        yield module, ready


def to_device(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Move initialised tensors (built on the CPU in exact mode) to ``device``, in place."""
    for t in tensors:
        if t.device != device:
            t.data = t.data.to(device)


def materialize(model: nn.Module, how: DeferredInit, device: torch.device) -> nn.Module:
    """Every meta tensor of ``model`` made real on ``device`` and initialised, module by
    module; the parameter objects stay the same (an optimizer built over them keeps them).
    Call it inside ``agreed(...)`` when several ranks must hold the same values. No sync
    point."""
    for _, tensors in walk(model, how, device):
        to_device(tensors, device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # cannot happen for a module tree; said plainly rather than failing later
        raise ConfigError(
            f"tensors left on the meta device after initialisation: {left[:5]}",
            fix="report this: every module with meta tensors should have been built.",
        )
    return model


def refresh_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """State an optimizer made at construction over meta parameters (Adagrad's sums), made
    again over the real ones (the parameter objects are the same)."""
    made = (v for s in optimizer.state.values() for v in s.values())
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in made):
        fresh = rebuild_optimizer(optimizer, [g["params"] for g in optimizer.param_groups])
        optimizer.state = fresh.state
