"""Model state without wrapper prefixes: the seed's pitfall 5 (``module.``) made impossible.

Wrappers add a level to parameter names: torch's DDP and DP as ``module.``, ``torch.compile`` as
``_orig_mod.``. A state dict saved through a wrapper then fails to load into the bare model
("Unexpected key(s) ... module.conv1.weight"). rankwise saves the bare model's state and, when
loading, accepts keys with or without those prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DDP/DP wrappers (ours or torch's) and ``torch.compile``."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def strip_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """Drop wrapper prefixes that EVERY key carries (a real submodule called ``module`` is kept
    unless every single key lives under it, which is exactly what a wrapper produces)."""
    out = dict(state)
    changed = True
    while changed and out:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in out):
                out = {k[len(prefix) :]: v for k, v in out.items()}
                changed = True
    return out


def model_state(model: nn.Module) -> dict[str, Any]:
    """The bare model's state dict: no ``module.``/``_orig_mod.`` whatever wraps it."""
    return strip_prefixes(unwrap_model(model).state_dict())
