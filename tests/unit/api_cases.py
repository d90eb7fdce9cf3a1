"""Bad inputs to the public API, generated from the signatures, and how each one ended.

Each entry point has a *builder*: it calls the entry point with valid arguments and one of
them replaced. The bad values for a parameter come from its annotation (``generated``: an
``int`` gets a string, a float and, where the annotation has no ``None``, None; an
``nn.Module`` gets None, a list of modules and a string; ...) plus a small table of values the
annotation cannot tell (negative or zero sizes, unknown names, wrong device strings; ``EXTRA``).
``outcome`` runs one case and says how it ended: ``named`` (a ``ConfigError`` whose message
names the argument and repeats the value), ``unnamed`` (a ``ConfigError`` that does not),
``raw`` (any other exception from inside rankwise or torch) or ``accepted`` (no error).

Used by tests/unit/test_api_validation.py (one process) and tests/dist/test_api_validation_dist.py
(world 2 on Gloo: mesh sizes, process groups, ranks of the job).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import rankwise as rw

SKIPPED_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
SCALARS = (int, float, str, bytes, type(None))


@dataclass(frozen=True)
class Entry:
    """One public entry point: ``build(tmp, **{param: value})`` calls it with every other
    argument valid; ``target``'s signature lists the parameters and their annotations."""

    name: str
    target: Callable[..., Any]
    build: Callable[..., Any]
    skip: tuple[str, ...] = ()
    """Parameters whose bad values come from ``EXTRA`` alone (none there: left out):
    booleans kept truthy as torch keeps them, values of any type, numbers torch itself reads
    with ``float()`` (so ``"1.0"`` is not wrong there)."""


@dataclass(frozen=True)
class Case:
    entry: Entry
    param: str
    value: Any

    @property
    def id(self) -> str:
        shown = repr(self.value) if isinstance(self.value, SCALARS) else type(self.value).__name__
        if isinstance(self.value, (list, dict, tuple)) and len(repr(self.value)) < 30:
            shown = repr(self.value)
        return f"{self.entry.name}({self.param}={shown})"


def _kinds(annotation: str) -> set[str]:
    return {p.strip() for p in annotation.replace("'", "").split("|")}


def generated(annotation: Any, default: Any, make: dict[str, Callable[[], Any]]) -> list[Any]:
    """Wrong types for a parameter, from its annotation (a string: ``from __future__ import
    annotations``); ``default`` tells whether it may be left out. ``make`` builds the objects
    of the wrong kind (a module where an optimizer goes, ...)."""
    if annotation is inspect.Parameter.empty:
        return []
    kinds = _kinds(str(annotation))
    required = "None" not in kinds and default is not None
    none = [None] if required else []
    if kinds & {"bool", "Any"}:
        return []  # truthy values are kept as torch keeps them; Any takes anything
    if kinds & {"int"} and not kinds & {"float", "str", "torch.device"}:
        return ["2", 2.5, *none]
    if "float" in kinds:
        return ["1.0", *none]
    if kinds & {"nn.Module", "nn.Linear", "nn.Embedding"}:
        return [*none, [make["module"]()], "model"]
    if any(k.startswith("torch.optim.Optimizer") for k in kinds):
        return [*none, "adam", make["module"]()]
    if "torch.Tensor" in kinds:
        return [*none, [1.0], "loss"]
    if "os.PathLike" in kinds or "Path" in kinds:
        return [*none, 3]
    if any(k.startswith("Mapping[str") for k in kinds):
        return [*none, [("data", 1)], "data"]
    if kinds <= {"str", "None"}:
        return [*none, 3]
    return []


def cases(entries: list[Entry], extra: dict[str, list[Any]], make: dict) -> list[Case]:
    """Every (entry, parameter, bad value): generated from the annotation, then ``extra``
    (keyed ``'<entry>.<param>'``)."""
    found: dict[tuple[str, str, str], Case] = {}
    for entry in entries:
        params = [p for p in inspect.signature(entry.target).parameters.values()
                  if p.name != "self" and p.kind not in SKIPPED_KINDS]  # fmt: skip
        wanted = {p.name: [] if p.name in entry.skip else generated(p.annotation, p.default, make)
                  for p in params}  # fmt: skip
        for key, values in extra.items():  # keyword arguments forwarded through **kwargs too
            owner, _, param = key.rpartition(".")
            if owner == entry.name:
                wanted[param] = wanted.get(param, []) + values
        for param, values in wanted.items():
            for v in values:  # the same value generated and listed counts once
                found.setdefault((entry.name, param, f"{type(v)}{v!r}"), Case(entry, param, v))
    return list(found.values())


def _shows_value(value: Any, text: str) -> bool:
    """The message repeats the value: its repr (a scalar), or for a container its repr, its
    type or one of its items (``devices[0]='tpu'``), for a tensor its shape or dtype, for an
    object its type."""
    if isinstance(value, SCALARS):
        return repr(value) in text
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape)) in text or str(value.dtype) in text
    if repr(value) in text or type(value).__name__ in text:
        return True
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return isinstance(value, (list, tuple, dict)) and any(repr(i) in text for i in items)


def outcome(case: Case, tmp: Path) -> tuple[str, str]:
    """('named' | 'unnamed' | 'raw' | 'accepted', what happened)."""
    try:
        case.entry.build(tmp, **{case.param: case.value})
    except rw.ConfigError as e:
        text = str(e)
        named = case.param.lower() in text.lower() and _shows_value(case.value, text)
        return ("named" if named else "unnamed"), f"{type(e).__name__}: {text}"
    except Exception as e:
        return "raw", f"{type(e).__name__}: {e}"
    finally:
        rw.shutdown()
    return "accepted", "no error"


def census(found: list[Case], tmp_for: Callable[[Case], Path]) -> dict[str, list[str]]:
    """Run every case; the cases by outcome, each with what happened."""
    result: dict[str, list[str]] = {"named": [], "unnamed": [], "raw": [], "accepted": []}
    for case in found:
        kind, detail = outcome(case, tmp_for(case))
        result[kind].append(f"{case.id}: {detail.splitlines()[0] if detail else ''}")
    return result


def summary(result: dict[str, list[str]]) -> str:
    tried = sum(len(v) for v in result.values())
    lines = [
        f"{tried} bad inputs tried: {len(result['named'])} ConfigError naming the argument, "
        f"{len(result['unnamed'])} ConfigError not naming it, {len(result['raw'])} raw errors, "
        f"{len(result['accepted'])} accepted"
    ]
    for kind in ("raw", "unnamed", "accepted"):
        lines += [f"  {kind}: {line}" for line in result[kind]]
    return "\n".join(lines)
