"""Checkpoints: what is saved (``state_dict``: the model without ``module.``, optimizer, RNG,
loader position), in which format (``single``: one verified file written by rank 0), and how
files are kept (``files``: atomic writes, ``latest``, rotation; ``verify``/``sums``: every
record checked on load)."""

from __future__ import annotations

from .files import LATEST, list_checkpoints
from .single import load_checkpoint, load_model_state, resolve, save_checkpoint
from .state_dict import unwrap_model

__all__ = [
    "LATEST",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_state",
    "resolve",
    "save_checkpoint",
    "unwrap_model",
]
