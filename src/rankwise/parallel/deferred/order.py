"""In what order a meta-built model's modules are initialised, and when each tensor is final.

**Order**: ``model.apply``'s — children before their parent (Hugging Face's ``post_init``
walks the same way). A parent's initialisation that sets a child's tensor (GPT-2's attention
block scaling its ``c_proj``) then runs after the child's, and wins, as in an eager build. With
``init=fn`` every module whose subtree still holds meta tensors is called, as ``model.apply(fn)``
would; by default only the modules with meta tensors of their own get ``reset_parameters()``
(the convention: a module resets its own tensors).

**Finality**: a parent may write its descendants' tensors, so a tensor is handed to the engine
(which keeps its slice and frees the rest) only after the last module whose initialisation
writes it has run. Which module writes which tensor is found before anything is allocated: each
initialisation is run once on the meta device (no memory, no random numbers) with its in-place
writes recorded by storage. A module whose dry run fails is assumed to write its whole subtree
(held until it ran: correct, at the cost of memory). A tensor written before its owner's turn
(a child setting its parent's tensor) is allocated at its first writer's turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import rng
from .modules import Init, has_meta, lend, own_tensors, restore, run_init, target_of

Step = tuple[str, nn.Module]
"""``(path, module)``: a module to initialise, in order."""


def post_order(model: nn.Module) -> list[Step]:
    """Every module once, children before their parent (``model.apply``'s order)."""
    out: list[Step] = []
    seen: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        seen.add(id(module))
        for name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{path}.{name}" if path else name, child)
        out.append((path or "<root>", module))

    visit("", model)
    return out


def steps(model: nn.Module, init: Init | None) -> list[Step]:
    """The modules to initialise, in order (see the module text)."""
    order = post_order(model)
    if init is None:
        return [(p, m) for p, m in order if has_meta(m)]
    below: dict[int, bool] = {}
    for _, m in order:  # children are listed first
        below[id(m)] = has_meta(m) or any(below.get(id(c), False) for c in m.children())
    return [(p, m) for p, m in order if below[id(m)]]


def _key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return None


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        out.extend(v for v in values if isinstance(v, torch.Tensor))
    return out


class _Writes(TorchDispatchMode):
    """Records the storages an initialisation writes; writes to real tensors (outside the meta
    model) are recorded and not performed (the dry run must change nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        self.storages.update(k for k in map(_key, written) if k is not None)
        if any(not t.is_meta for t in written):
            return written[0] if len(written) == 1 else tuple(written)
        return func(*args, **kwargs)


@dataclass
class Schedule:
    """When each meta tensor (by ``id``) is allocated and when it is final."""

    first: dict[int, int] = field(default_factory=dict)
    """Step at which the tensor is made real: its first writer's or its owner's."""
    last: dict[int, int] = field(default_factory=dict)
    """Step after which the tensor is final (its last writer's)."""
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    guessed: list[str] = field(default_factory=list)
    """Modules whose dry run failed (assumed to write their whole subtree)."""

    def wrote(self, tid: int, i: int) -> None:
        self.first[tid] = min(self.first.get(tid, i), i)
        self.last[tid] = max(self.last.get(tid, i), i)


def _meta_tensors(module: nn.Module) -> list[torch.Tensor]:
    found = [*module.parameters(), *module.buffers()]
    return [t for t in found if t.is_meta]


def _dry_run(path: str, module: nn.Module, init: Init | None, owned: set[int]) -> set[int] | None:
    """Storages ``init`` (or ``reset_parameters()``) writes when run on ``module``; None when
    it fails on the meta device. Tied tensors an earlier module owns are lent, as in the real
    run. No memory, no random numbers, no sync point."""
    target = target_of(module)
    lent = lend(target, owned, torch.device("meta"))
    mode = _Writes()
    try:
        with mode:
            run_init(target, path, init)
    except Exception:
        return None
    finally:
        restore(target, lent)
    return mode.storages


def schedule(order: list[Step], init: Init | None, device: torch.device) -> Schedule:
    """Dry-run every step on the meta device (the random state is left as it was)."""
    found = Schedule()
    for _, m in order:
        for t in _meta_tensors(m):
            found.tensors.setdefault(id(t), t)
    by_key = {k: tid for tid, t in found.tensors.items() if (k := _key(t)) is not None}
    owned: set[int] = set()
    state = rng.get_state(device)
    try:
        for i, (path, m) in enumerate(order):
            mine = [id(t) for _, _, t in own_tensors(m) if t.is_meta]
            for tid in mine:
                found.wrote(tid, i)
            writes = _dry_run(path, m, init, owned)
            owned.update(mine)
            if writes is None:
                found.guessed.append(path)
                hit = [id(t) for t in _meta_tensors(m)]
            else:
                hit = [by_key[k] for k in writes if k in by_key]
            for tid in hit:
                found.wrote(tid, i)
    finally:
        rng.set_state(device, state)
    return found


def released_at(found: Schedule) -> dict[int, list[torch.Tensor]]:
    """Step index -> the tensors final after it."""
    out: dict[int, list[torch.Tensor]] = {}
    for tid, i in found.last.items():
        out.setdefault(i, []).append(found.tensors[tid])
    return out


def early_at(found: Schedule, order: list[Step]) -> dict[int, list[torch.Tensor]]:
    """Step index -> tensors to allocate before it runs (written before their owner's turn)."""
    owner = {}
    for i, (_, m) in enumerate(order):
        for _, _, t in own_tensors(m):
            owner.setdefault(id(t), i)
    out: dict[int, list[torch.Tensor]] = {}
    for tid, i in found.first.items():
        if i < owner.get(tid, i):
            out.setdefault(i, []).append(found.tensors[tid])
    return out
