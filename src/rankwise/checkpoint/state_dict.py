"""Model state without wrapper prefixes: pitfall 5 (``module.``, docs/pitfalls.md#pitfall-5) made impossible.

Wrappers add a level to parameter names: torch's DDP and DP as ``module.``, ``torch.compile`` as
``_orig_mod.``. A state dict saved through a wrapper then fails to load into the bare model
("Unexpected key(s) ... module.conv1.weight"). rankwise saves the bare model's state and, when
loading, accepts keys with or without those prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .. import validate

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DDP/DP wrappers (ours or torch's) and ``torch.compile``."""
    validate.stateful("model", model, where="rw.unwrap_model()")
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def registered_inner(model: nn.Module) -> nn.Module:
    """The user's model under any wrappers, found through the registered submodules rather
    than the ``.module`` attribute (a stage-3 model refuses that outside ``full_parameters``:
    its parameters are sharded). For its structure (class, submodule names), not its values."""
    while True:
        inner = model._modules.get("_orig_mod") or model._modules.get("module")
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def model_class_name(model: nn.Module) -> str:
    """The class name of the user's model under any wrappers (see ``registered_inner``)."""
    return type(registered_inner(model)).__name__


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


# -- hooks for wrappers (our DDP and DP): the wrapper level never shows in keys ----------

PREFIX = "module."


def strip_module_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict post-hook: ``module.fc.weight`` -> ``fc.weight`` (docs/pitfalls.md#pitfall-5)."""
    head = prefix + PREFIX
    for key in [k for k in state_dict if k.startswith(head)]:
        state_dict[prefix + key[len(head) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        old = head[:-1]
        for key in [k for k in metadata if k == old or k.startswith(head)]:
            new = prefix[:-1] if key == old else prefix + key[len(head) :]
            metadata[new] = metadata.pop(key)


def add_module_prefix(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    *args: Any,
) -> None:
    """load_state_dict pre-hook: accept keys with or without ``module.``."""
    inner = getattr(module, "module", None)
    ambiguous = isinstance(inner, nn.Module) and "module" in inner._modules
    head = prefix + PREFIX
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key.startswith(head) and not ambiguous:
            continue
        state_dict[head + key[len(prefix) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None and prefix == "" and head[:-1] not in metadata and "" in metadata:
        for key in [k for k in metadata if not k.startswith(head)]:
            metadata[head + key if key else head[:-1]] = metadata[key]
