"""Rebuild a torch optimizer over other tensors, keeping every parameter group's settings.

The sharded engine builds the user's optimizer again over this rank's flat shards, the
asynchronous parameter server over its own copy of the parameters. Both must produce the same
class with the same hyperparameters, group by group. Two shortcuts are wrong:

- ``cls(params, **optimizer.defaults)``: ``defaults`` may hold keys the constructor refuses
  (torch's AdamW keeps ``decoupled_weight_decay`` there, which only Adam's constructor takes),
  and it forgets what each group changed (nanoGPT's and Hugging Face's decay / no-decay groups).
- one group: the groups' own learning rates and weight decays would be lost.

So each new group is the old group's settings with other tensors, and the constructor gets only
the defaults its signature names (what it validates and what sets up its fused/foreach paths).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError


def group_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}


def _constructor_defaults(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, params_per_group: Sequence[Sequence[torch.Tensor]]
) -> torch.optim.Optimizer:
    """``type(optimizer)`` over new tensors: group ``g`` gets ``params_per_group[g]`` with
    ``optimizer.param_groups[g]``'s settings (an empty list keeps an empty group, so group
    ``g`` is group ``g`` in both). The result holds
    no state (load it with ``load_state_dict`` if wanted). No sync point."""
    if len(params_per_group) != len(optimizer.param_groups):
        raise ValueError(
            f"{len(params_per_group)} parameter lists for {len(optimizer.param_groups)} groups"
        )
    cls = type(optimizer)
    groups = [
        {**group_settings(g), "params": list(ps)}
        for g, ps in zip(optimizer.param_groups, params_per_group, strict=True)
    ]
    try:
        return cls(groups, **_constructor_defaults(cls, optimizer.defaults))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"cannot build {cls.__name__} again from its parameter groups ({exc})",
            fix="use a torch.optim optimizer, or one whose constructor takes a list of "
            "parameter groups (dicts) plus its defaults as keywords, as torch's do.",
        ) from exc
