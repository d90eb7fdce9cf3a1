"""Which loaders given to ``rt.prepare_loader`` are evaluation loaders (docs/data.md,
"Evaluation loaders are exact by default").

A padding sampler gives every rank the same number of samples by repeating a few: 101 test
samples on 2 ranks become 102, and an accuracy counted over them is off, silently. So
``rt.prepare_loader(loader)`` without ``evaluation=`` decides: an unshuffled loader that is
named as evaluation data (``test``, ``val``, ``eval``, ``dev``, ``holdout`` in the names on the
user's line, or a data set with ``train=False`` or ``split='test'``) is prepared for exact
evaluation, each sample once; any other unshuffled loader that pads is prepared as before, with
a warning that names the number of duplicates and ``evaluation=True``.
"""

from __future__ import annotations

import linecache
import re
from typing import Any

from torch.utils.data import DataLoader, SequentialSampler

from ..data import Loader
from .guards import user_frame

EVALUATION_WORDS = frozenset(
    {"test", "tests", "val", "valid", "validation", "eval", "evaluation", "dev", "holdout"}
)
"""Words that name evaluation data: a part of an identifier split at '_' and case changes."""

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PART = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")


def _named_words(line: str) -> list[str]:
    """The evaluation words in the identifiers of ``line`` (strings and comments left out)."""
    code = re.sub(r"#.*$|'[^']*'|\"[^\"]*\"", " ", line)
    found = []
    for ident in _IDENT.findall(code):
        parts = [p.lower() for piece in ident.split("_") for p in _PART.findall(piece)]
        found += [f"'{ident}'" for p in parts if p in EVALUATION_WORDS][:1]
    return found


def _dataset_says(dataset: Any) -> str | None:
    """The data set's own word for evaluation (torchvision's ``train=False``, a ``split``)."""
    if getattr(dataset, "train", None) is False:
        return f"{type(dataset).__name__}(train=False)"
    split = getattr(dataset, "split", None)
    if isinstance(split, str) and split.lower() in EVALUATION_WORDS:
        return f"{type(dataset).__name__}(split={split!r})"
    return None


def evaluation_reason(loader: Any) -> str | None:
    """Why ``loader`` (a plain unshuffled DataLoader, nothing dropped) is evaluation data, or
    None. Looked up on the user's line that called ``rt.prepare_loader``."""
    if not isinstance(loader, DataLoader) or isinstance(loader, Loader):
        return None
    if type(loader.sampler) is not SequentialSampler or loader.drop_last:
        return None
    said = _dataset_says(loader.dataset)
    if said is not None:
        return said
    frame, _ = user_frame(2)
    if frame is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    words = _named_words(line)
    return f"named {words[0]} on the line that prepares it" if words else None


def padding_warning(loader: Any, prepared: Any) -> str | None:
    """The warning for an unshuffled loader not recognised as evaluation whose sampler repeats
    samples to even out the ranks, or None."""
    if not isinstance(loader, DataLoader) or type(loader.sampler) is not SequentialSampler:
        return None
    sampler = getattr(prepared.loader.dataloader, "sampler", None)
    n, total = getattr(sampler, "_n", None), getattr(sampler, "total_size", None)
    if not isinstance(n, int) or not isinstance(total, int) or total <= n:
        return None
    world = sampler.num_replicas
    return (
        f"rt.prepare_loader: this unshuffled loader of {n} samples is padded to {total} over "
        f"{world} ranks: {total - n} sample(s) are read twice in every pass, so a count or a "
        f"metric gathered over it covers {total} samples, not {n}. Fix: for evaluation, "
        "rt.prepare_loader(loader, evaluation=True) (each sample once; docs/data.md); for "
        "training, pass evaluation=False to keep the padding and silence this."
    )
