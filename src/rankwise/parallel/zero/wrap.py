"""Stage 3's wrap policy: which modules are gathered as one unit (FSDP's ``auto_wrap_policy``).

A unit's parameters are all-gathered just before its forward and freed after, so the unit is
the grain of stage 3's memory: the peak holds the largest unit (plus prefetch), not the model.
Transformers repeat one block class in a ``ModuleList`` (nanoGPT's ``transformer.h``, Hugging
Face's ``transformer.h`` / ``model.layers``); one unit per block is what FSDP users write by
hand (``ModuleWrapPolicy({Block})``). Without a policy that block is never a unit when it is
smaller than the size threshold, and a ``ModuleList`` is never called, so the whole model
became one unit, gathered for the whole step.

``wrap=`` accepts:

- ``None`` (the default): every child of a ``ModuleList``/``Sequential`` whose children are
  two or more modules of one class (the repeated blocks), plus any other module whose
  unclaimed parameters reach ``unit_numel`` elements;
- a module class or a tuple/set of classes: exactly the modules of those classes;
- a function ``module -> bool``: exactly the modules it accepts.

The root module always holds what no unit claimed (embeddings, tied weights, the final norm).
Pure: nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from ...errors import ConfigError

WrapPolicy = Any
"""``None``, a module class, a tuple/set of classes, or ``Callable[[nn.Module], bool]``."""


def repeated_blocks(root: nn.Module) -> set[int]:
    """``id`` of every child of a container holding 2+ modules of one class with parameters."""
    found: set[int] = set()
    for mod in root.modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = [c for c in mod.children() if any(True for _ in c.parameters())]
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            found.update(id(c) for c in children)
    return found


def _classes(wrap: Iterable[Any]) -> tuple[type, ...]:
    classes = tuple(wrap)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad or not classes:
        raise ConfigError(
            f"wrap={wrap!r} must name module classes (got {bad or 'none'})",
            fix="pass e.g. wrap={Block} (nanoGPT) or wrap={GPT2Block}, or a function "
            "module -> bool, or leave it out to wrap each repeated block.",
        )
    return classes


def resolve(wrap: WrapPolicy, root: nn.Module) -> Callable[[nn.Module], bool | None] | None:
    """The predicate ``layout.module_units`` applies: True/False decides, None leaves it to the
    size rule (``None`` as the predicate: the size rule alone)."""
    if wrap is None:
        blocks = repeated_blocks(root)
        if not blocks:
            return None
        return lambda m: True if id(m) in blocks else None
    if isinstance(wrap, type):
        wrap = (wrap,)
    if isinstance(wrap, (tuple, list, set, frozenset)):
        classes = _classes(wrap)
        return lambda m: isinstance(m, classes)
    if callable(wrap):
        return lambda m: bool(wrap(m))
    raise ConfigError(
        f"wrap={wrap!r} is not a wrap policy",
        fix="pass a module class, a set of classes, a function module -> bool, or None.",
    )
