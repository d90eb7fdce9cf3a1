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

**Order.** Modules are initialised in registration order (``model.named_modules()``: a parent
before its children, children in the order they were assigned). When the model's eager
constructor draws its random numbers in that same order — every module initialising its own
tensors as it is built, nothing else drawing — and every rank holds the same CPU generator
state, the *exact* mode reproduces an eager CPU build bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ConfigError
from ..optimizers import rebuild_optimizer
from .modules import Init, full_module, has_meta, init_module, own_tensors
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
    """``init(module)`` for every module with tensors of its own on the meta device, in
    registration order, instead of its ``reset_parameters()``."""
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


def meta_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every module to initialise, in registration order, listed before
    any is touched (a tied weight's second owner is still listed once the first built it)."""
    return [(path or "<root>", m) for path, m in model.named_modules() if has_meta(m)]


Built = tuple[nn.Module, list[torch.Tensor]]
"""A module whose meta tensors were just initialised, and those tensors (the same objects)."""


def walk(model: nn.Module, how: DeferredInit, device: torch.device) -> Iterator[Built]:
    """Initialise the meta modules one by one on ``how.build_device(device)``; yields each
    module with its newly real tensors. No sync point."""
    done: set[int] = set()
    build = how.build_device(device)
    for path, module in meta_modules(model):
        yield module, init_module(module, path, how.init, build, done)


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
