"""Argument checks for the public entry points: a wrong type or value is a ``ConfigError``.

Each check runs at the top of an entry point, before anything is built or sent, and raises
``ConfigError`` (a ``ValueError``) in the shape of errors.py: the argument's name and the
user's own value, what it must be, and the fix — ``rw.loader(): seed='2' (str) must be an
int. Fix: pass e.g. seed=0.`` A valid argument passes untouched (nothing is converted), so a
check never changes what a correct call does. ``where`` names the call (``'rw.loader()'``).

Ground floor, and free of torch at import (the checks that name torch types import it), so
``env`` and ``mesh`` use it and the commands that need no torch (``rankwise check``,
``rankwise topology``) still start without it.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn

from .errors import ConfigError

_SHOWN = 80


def shown(value: Any) -> str:
    """``repr(value)``, cut to a readable length (a model's repr is pages long)."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def fail(name: str, value: Any, expected: str, *, where: str = "", fix: str) -> NoReturn:
    """``[where: ]name=<value> (<type>) must be <expected>``, with the fix."""
    prefix = f"{where}: " if where else ""
    raise ConfigError(
        f"{prefix}{name}={shown(value)} ({type(value).__name__}) must be {expected}", fix=fix
    )


def is_int(value: Any) -> bool:
    """An integer (Python's, numpy's), not a bool nor a float that happens to be whole."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    optional: bool = False,
    where: str = "",
    example: int | None = None,
) -> None:
    """An int, ``>= minimum`` when given; None too when ``optional``."""
    if value is None and optional:
        return
    good = minimum if example is None else example
    fix = f"pass an integer{'' if minimum is None else f' >= {minimum}'}, e.g. {name}={good or 0}."
    if not is_int(value):
        fail(name, value, "an int" + (" or None" if optional else ""), where=where, fix=fix)
    if minimum is not None and value < minimum:
        fail(name, value, f"an int >= {minimum}", where=where, fix=fix)


def number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    positive: bool = False,
    optional: bool = False,
    numeric_text: bool = False,
    where: str = "",
    example: float = 1.0,
) -> None:
    """A real number (``positive``: > 0; ``minimum``: >= it); ``numeric_text``: also a string
    ``float()`` reads, where torch's own function reads it so ('inf' for a norm type)."""
    if value is None and optional:
        return
    bound = " > 0" if positive else "" if minimum is None else f" >= {minimum}"
    fix = f"pass a number{bound}, e.g. {name}={example}."
    expected = f"a number{bound}" + (" or None" if optional else "")
    num = value
    if isinstance(value, str) and numeric_text:
        try:
            num = float(value)
        except ValueError:
            fail(name, value, expected, where=where, fix=fix)
    if isinstance(num, bool) or not isinstance(num, numbers.Real):
        fail(name, value, expected, where=where, fix=fix)
    if (positive and not num > 0) or (minimum is not None and not num >= minimum):
        fail(name, value, expected, where=where, fix=fix)


def timeout(name: str, value: Any, *, where: str = "") -> None:
    """None, or a positive number of seconds or ``timedelta``."""
    if value is None:
        return
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    fix = f"pass the seconds to wait, e.g. {name}=300."
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        fail(name, value, "a number of seconds, a timedelta or None", where=where, fix=fix)
    if not seconds > 0:
        raise ConfigError(f"{where + ': ' if where else ''}{name}={value!r} must be positive",
                          fix=fix)  # fmt: skip


def choice(
    name: str, value: Any, choices: Iterable[Any], *, where: str = "", optional: bool = False
) -> None:
    """One of ``choices`` (None too when ``optional``)."""
    options = list(choices)
    if (value is None and optional) or (isinstance(value, str) and value in options):
        return
    listed = ", ".join(repr(c) for c in options)
    fail(name, value, f"one of {listed}", where=where, fix=f"pass {name}={options[0]!r}.")


def switch(name: str, value: Any, *, where: str = "") -> None:
    """None (decide for me), True (insist) or False (never): a string such as "false" is
    truthy, and would insist."""
    if value is None or isinstance(value, bool):
        return
    fail(name, value, "True, False or None", where=where,
         fix=f"pass {name}=False to turn it off, True to insist, or leave it out (None).")  # fmt: skip


def text(name: str, value: Any, *, where: str = "", optional: bool = False) -> None:
    """A string (None too when ``optional``)."""
    if (value is None and optional) or isinstance(value, str):
        return
    fail(name, value, "a str", where=where, fix=f"pass {name} as a string.")


def module(name: str, value: Any, *, where: str = "", optional: bool = False) -> None:
    """A ``torch.nn.Module`` (a list of modules is the usual mistake: wrap it first)."""
    from torch import nn

    if (value is None and optional) or isinstance(value, nn.Module):
        return
    fix = f"pass one model, e.g. {name}=nn.Sequential(*layers) for a list of layers."
    fail(name, value, "a torch.nn.Module", where=where, fix=fix)


def is_optimizer(value: Any) -> bool:
    """A ``torch.optim.Optimizer``, or an object with ``state_dict`` and ``load_state_dict``
    that is not a module (a wrapper such as ``FullOptimState``; a model is the usual mistake)."""
    import torch
    from torch import nn

    if isinstance(value, torch.optim.Optimizer):
        return True
    has_state = callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )
    return has_state and not isinstance(value, (nn.Module, type))


def optimizer(name: str, value: Any, *, where: str = "", optional: bool = True) -> None:
    """An optimizer (``is_optimizer``); None too when ``optional``."""
    if (value is None and optional) or is_optimizer(value):
        return
    fix = f"pass the optimizer, e.g. {name}=torch.optim.AdamW(model.parameters())."
    fail(name, value, "a torch.optim.Optimizer", where=where, fix=fix)


def stateful(name: str, value: Any, *, where: str = "", optional: bool = False) -> None:
    """A model for a checkpoint: a module, or an object with ``state_dict`` and
    ``load_state_dict`` (a view such as ``FullState``); not a list of them."""
    from torch import nn

    if value is None and optional:
        return
    if isinstance(value, nn.Module) or (
        callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    ):
        return
    fix = f"pass one model, e.g. {name}=model (a list of layers: nn.Sequential(*layers))."
    fail(name, value, "a torch.nn.Module", where=where, fix=fix)


def path(name: str, value: Any, *, where: str = "", optional: bool = False) -> None:
    """A file or folder name: ``str`` or ``os.PathLike``."""
    if (value is None and optional) or isinstance(value, (str, os.PathLike)):
        return
    fail(name, value, "a path (str or os.PathLike)", where=where, fix=f"pass e.g. {name}='ckpt/'.")


def mapping(name: str, value: Any, expected: str, *, where: str = "", example: str) -> None:
    """A ``Mapping`` (a dict); ``expected`` says of what."""
    if not isinstance(value, Mapping):
        fail(name, value, expected, where=where, fix=f"pass e.g. {name}={example}.")


def sequence(name: str, value: Any, expected: str, *, where: str = "", example: str) -> None:
    """A list or tuple (not a string, a number or a lone device)."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        fail(name, value, expected, where=where, fix=f"pass e.g. {name}={example}.")


def iterable(name: str, value: Any, *, where: str = "") -> None:
    """Something ``iter()`` takes (``__iter__``, or ``__getitem__`` as a sequence)."""
    if not (hasattr(value, "__iter__") or hasattr(value, "__getitem__")):
        fail(name, value, "an iterable", where=where, fix=f"pass the {name} to go through.")


def process_group(name: str, value: Any, *, where: str = "") -> None:
    """None (the default group) or a ``torch.distributed.ProcessGroup``."""
    import torch.distributed as dist

    if value is None or isinstance(value, dist.ProcessGroup):
        return
    fix = f"pass a group made by torch.distributed.new_group(ranks) (or rt.mesh), or {name}=None."
    fail(name, value, "a torch.distributed.ProcessGroup or None", where=where, fix=fix)


def tensor(
    name: str, value: Any, *, where: str = "", dtypes: str = "", fix: str | None = None
) -> None:
    """A ``torch.Tensor`` (``dtypes`` 'int': of an integer dtype)."""
    import torch

    if not isinstance(value, torch.Tensor):
        fail(name, value, "a torch.Tensor", where=where, fix=fix or f"pass {name} as a tensor.")
    if dtypes == "int" and (value.dtype.is_floating_point or value.dtype.is_complex):
        raise ConfigError(
            f"{where + ': ' if where else ''}{name} has dtype {value.dtype}, not an integer one",
            fix=f"pass class indices, e.g. {name}.long().",
        )


def device_name(name: str, value: Any, *, where: str = "") -> None:
    """A name ``torch.device`` reads ('cpu', 'cuda:1'), an int, a ``torch.device`` or None."""
    import torch

    if value is None or isinstance(value, torch.device) or is_int(value):
        return
    try:
        torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        fail(name, value, "a device", where=where, fix=f"pass e.g. {name}='cpu' or 'cuda:0'.")
