"""One module built on the meta device given real tensors, initialised in place.

A module's *own* tensors are its parameters and buffers without recursion
(``module._parameters``, ``module._buffers``). Each meta one is swapped, object for object
(``torch.utils.swap_tensors``), with an uninitialised tensor on the target device, so every
reference to the parameter — the optimizer's param groups, a tied second owner, the engine's
lists — sees the real tensor without being told. Floating tensors start as NaN: whatever the
initialisation leaves unset is then found and named instead of training on garbage.

The module is then initialised by ``init(module)`` or, by default, its ``reset_parameters()``
(the convention torch's layers and FSDP follow: it sets the module's own parameters and
buffers). A tensor that an earlier module already initialised (a weight tied after
construction, ``lm_head.weight = wte.weight``) is lent a scratch tensor for the call, so the
later owner draws its random numbers as its eager constructor did, and the draw is discarded
as the tie discarded it.

A module *cut from a full one* (a tensor-parallel layer made from a meta ``nn.Linear``) names
that module as ``_full_module`` and cuts a full tensor into its piece with ``cut(name, full)``:
the full module is initialised whole, each piece cut, the full tensors released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError

Init = Callable[[nn.Module], Any]
"""``init(module)``: set ``module``'s own parameters and buffers (not its children's)."""


def own_tensors(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """``(kind, name, tensor)`` of the module's own parameters and buffers."""
    out = [("parameter", n, p) for n, p in module._parameters.items() if p is not None]
    return out + [("buffer", n, b) for n, b in module._buffers.items() if b is not None]


def full_module(module: nn.Module) -> nn.Module | None:
    """The meta module a tensor-parallel layer was cut from, while it waits to be built."""
    return module.__dict__.get("_full_module")


def has_meta(module: nn.Module) -> bool:
    """True when any own tensor of ``module`` (or of the module it was cut from) is meta."""
    source = full_module(module)
    tensors = own_tensors(module) + (own_tensors(source) if source is not None else [])
    return any(t.is_meta for _, _, t in tensors)


def _real(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like ``t`` on ``device``: NaN where the dtype has one."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    else:
        out.zero_()
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def _slot(module: nn.Module, kind: str) -> dict[str, Any]:
    return module._parameters if kind == "parameter" else module._buffers


def lend(
    module: nn.Module, done: set[int], device: torch.device
) -> list[tuple[str, str, torch.Tensor]]:
    """Scratch tensors in the slots of own tensors an earlier module initialised (a weight
    tied after construction); returns the originals, to ``restore`` after the call."""
    lent = [(k, n, t) for k, n, t in own_tensors(module) if id(t) in done]
    for kind, name, t in lent:
        _slot(module, kind)[name] = _real(t, device)
    return lent


def restore(module: nn.Module, lent: list[tuple[str, str, torch.Tensor]]) -> None:
    for kind, name, t in lent:
        _slot(module, kind)[name] = t


def _allocate(
    module: nn.Module, path: str, device: torch.device, done: set[int], early: set[int]
) -> list[tuple[str, str, torch.Tensor]]:
    """Real storage for the module's own meta tensors (those in ``early`` were made real at
    an earlier writer's turn); returns what its initialisation must set."""
    own = [(k, n, t) for k, n, t in own_tensors(module) if id(t) not in done]
    if not any(t.is_meta or id(t) in early for _, _, t in own):
        return []  # nothing of its own to build (a parent called for its children's sake)
    allocated = []
    for kind, name, t in own:
        if t.is_meta:
            torch.utils.swap_tensors(t, _real(t, device))
        elif id(t) not in early:
            raise ConfigError(
                f"module {path!r} ({type(module).__name__}) holds {kind} {name!r} on "
                f"{t.device} beside tensors on the meta device; its initialisation would "
                "overwrite it",
                fix="build the whole module under `with torch.device('meta'):`, or none of it.",
            )
        allocated.append((kind, name, t))
    return allocated


def make_real(t: torch.Tensor, device: torch.device) -> None:
    """Allocate a meta tensor before its owner's turn (an earlier module writes it)."""
    torch.utils.swap_tensors(t, _real(t, device))


def run_init(module: nn.Module, path: str, init: Init | None) -> None:
    """``init(module)``, or the module's ``reset_parameters()`` (refused when it has none)."""
    with torch.no_grad():
        if init is not None:
            init(module)
            return
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            cls = type(module).__name__
            what = ", ".join(f"{k} {n!r}" for k, n, _ in own_tensors(module))
            raise ConfigError(
                f"module {path!r} ({cls}) was built on the meta device and has no "
                f"reset_parameters() to initialise its {what}",
                fix=f"give {cls} a reset_parameters() that sets its own parameters and buffers "
                "(the convention of torch's layers and FSDP), or pass an init function: "
                "rt.prepare(model, optimizer, init=fn), fn(module) setting each module's own "
                "tensors.",
            )
        reset()


def _any_nan(t: torch.Tensor) -> bool:
    """``t.isnan().any()`` a million elements at a time (no mask as large as ``t``)."""
    return any(bool(part.isnan().any()) for part in t.detach().reshape(-1).split(1 << 20))


def check_set(
    module: nn.Module, path: str, allocated: list[tuple[str, str, torch.Tensor]], init: Init | None
) -> None:
    """Refuse a tensor the initialisation left (partly) unset: it still holds NaN."""
    by = "the init function" if init is not None else "reset_parameters()"
    for kind, name, t in allocated:
        if (t.is_floating_point() or t.is_complex()) and _any_nan(t):
            raise ConfigError(
                f"{by} of module {path!r} ({type(module).__name__}) left {kind} {name!r} "
                "(partly) unset: it still holds the NaN it was allocated with",
                fix=f"set every parameter and buffer of {type(module).__name__} in {by} (a "
                "buffer computed in __init__, such as a causal mask or a rotary table, must "
                "be computed there again).",
            )


def _release(module: nn.Module, keep: set[int]) -> None:
    """Send the full module's tensors back to the meta device (its pieces are cut)."""
    for _kind, _name, t in own_tensors(module):
        if id(t) not in keep and not t.is_meta:
            torch.utils.swap_tensors(t, _like_meta(t))


def _like_meta(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def _cut(module: nn.Module, source: nn.Module, done: set[int]) -> list[torch.Tensor]:
    """Give the layer's own meta tensors their pieces of the source's (now real) tensors."""
    out = []
    for kind, name, t in own_tensors(module):
        if id(t) in done or not t.is_meta:
            continue
        piece = module.cut(name, getattr(source, name).detach())
        swap = nn.Parameter(piece, requires_grad=t.requires_grad) if kind == "parameter" else piece
        torch.utils.swap_tensors(t, swap)
        out.append(t)
    return out


def target_of(module: nn.Module) -> nn.Module:
    """The module whose tensors an initialisation sets: the full one a tensor-parallel layer
    was cut from, while it waits to be built, else the module itself."""
    source = full_module(module)
    return module if source is None else source


def init_module(
    module: nn.Module,
    path: str,
    init: Init | None,
    device: torch.device,
    done: set[int],
    early: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[tuple[str, str, torch.Tensor]]:
    """Give ``module``'s own meta tensors real values on ``device`` and run its
    initialisation; returns ``(kind, name, tensor)`` of the tensors it owns (each the same
    object as before), not yet checked for NaN: a parent may still set them (``check_set``
    once final). ``done``: ids of tensors already initialised by an earlier owner (updated).
    A tensor-parallel layer's pieces are cut here (its full module checked first).
    No sync point."""
    source = full_module(module)
    target = target_of(module)
    allocated = _allocate(target, path, device, done, early)
    # a module with nothing of its own to build (called for its children) writes scratch only
    skip = done if allocated else done | {id(t) for _, _, t in own_tensors(target)}
    lent = lend(target, skip, device)
    try:
        run_init(target, path, init)
    finally:
        restore(target, lent)
    done.update(id(t) for _, _, t in allocated)
    if source is None:
        return allocated
    check_set(target, path, allocated, init)
    mine = _cut(module, source, done)
    done.update(id(t) for t in mine)
    keep = {id(t) for _, _, t in own_tensors(module)}
    _release(source, keep)
    del module.__dict__["_full_module"]
    own = {id(t): (k, n) for k, n, t in own_tensors(module)}
    return [(*own[id(t)], t) for t in mine] + [e for e in allocated if id(e[2]) in keep]
