"""Checkpoints: what is saved (``state_dict``: the model without ``module.``, optimizer, RNG,
loader position), in which format (``single``: one verified file written by rank 0;
``sharded_save``/``sharded_load``: torch DCP's folder, every rank writing and reading its own
pieces), and how files are kept (``files``: atomic writes, ``latest``, rotation; ``verify``/
``sums``/``digests``: every record checked on load). ``api`` chooses the format.
"""

from __future__ import annotations

from .api import load_checkpoint, resolve, save_checkpoint
from .files import LATEST, list_checkpoints
from .single import load_model_state
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
