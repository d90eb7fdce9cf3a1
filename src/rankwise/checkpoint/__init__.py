"""Checkpoints: what is saved (``state_dict``: the model without ``module.``, optimizer, RNG,
loader position), in which format (``single``: one verified file written by rank 0;
``sharded_save``/``sharded_load``: torch DCP's folder, every rank writing and reading its own
pieces; ``pretrained``: Hugging Face safetensors), and how files are kept (``files``: atomic
writes, ``latest``, rotation; ``zipcheck``/``verify``/``sums``: the zip structure and every
record checked on load; ``digest``/``digest_file``: the XXH3 digest, for other files too;
``digests``: the sharded format's per-file and per-item checksums). ``api`` chooses the format.

The names below load on first use, as ``rankwise``'s own do: importing this package (which
``rankwise checkpoint``'s parser does, ``checkpoint/command/cli.py``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "LATEST": ".files",
    "digest": ".sums",
    "digest_file": ".sums",
    "list_checkpoints": ".files",
    "load_checkpoint": ".api",
    "load_model_state": ".single",
    "resolve": ".api",
    "save_checkpoint": ".api",
    "unwrap_model": ".state_dict",
}
"""Name -> the module of this package that defines it."""

__all__ = [
    "LATEST",
    "digest",
    "digest_file",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_state",
    "resolve",
    "save_checkpoint",
    "unwrap_model",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


if TYPE_CHECKING:  # static analysers and IDEs see the eager imports
    from .api import load_checkpoint, resolve, save_checkpoint
    from .files import LATEST, list_checkpoints
    from .single import load_model_state
    from .state_dict import unwrap_model
    from .sums import digest, digest_file
