"""Checkpoints: what is saved (``state_dict``: the model without ``module.``, optimizer, RNG,
loader position), in which format (``single``: one verified file written by rank 0), and how
files are kept (``files``: atomic writes, ``latest``, rotation; ``zipcheck``/``verify``/``sums``:
the zip structure and every record checked on load; ``digest``/``digest_file``: the XXH3
digest, for other files too)."""

from __future__ import annotations

from .files import LATEST, list_checkpoints
from .single import load_checkpoint, load_model_state, resolve, save_checkpoint
from .state_dict import unwrap_model
from .sums import digest, digest_file

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
