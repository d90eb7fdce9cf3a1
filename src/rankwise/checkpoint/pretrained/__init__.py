"""Pretrained weights in Hugging Face's safetensors format, straight into this rank's shards
(``load_pretrained``), and the consolidated model written back out, streamed
(``save_pretrained``). docs/pretrained.md."""

from __future__ import annotations

from .export import save_pretrained
from .load import PretrainedLoad, load_pretrained

__all__ = ["PretrainedLoad", "load_pretrained", "save_pretrained"]
