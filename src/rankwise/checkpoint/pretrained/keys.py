"""Which tensor of the file fills which tensor of the model (pure: names in, names out).

A file's names and a model's fully qualified names (FQNs) differ in known ways:

- a base model saved alone (``GPT2Model.save_pretrained``, ``LlamaModel``...) has no
  ``transformer.`` / ``model.`` prefix, and a task model's file loaded into the base model has
  one too many: the model's ``base_model_prefix`` (Hugging Face's attribute) is added or
  dropped, as ``from_pretrained`` does;
- wrapper prefixes (``module.`` from DDP/DP, ``_orig_mod.`` from ``torch.compile``) are dropped;
- a tied weight (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is stored once, under
  any one of its names;
- anything else is the user's ``key_map``: a function ``file name -> model name`` (None: skip
  the tensor), or a mapping of regular expressions to replacements applied to the file's names,
  the first pattern that matches (``from_pretrained(key_mapping=...)``'s rule).

A name the model has exactly always wins over one reached by a prefix rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from ...errors import ConfigError
from ..state_dict import WRAPPER_PREFIXES

KeyMap = Callable[[str], "str | None"] | Mapping[str, str] | None
"""``key_map=``: a rename function (None: skip) or ``{regex: replacement}`` (first match)."""


@dataclass(frozen=True)
class Resolution:
    """The outcome: model name -> file name, and the file's names that fill nothing."""

    chosen: dict[str, str]
    unexpected: list[str]
    skipped: list[str]


def rename_function(key_map: KeyMap) -> Callable[[str], str | None]:
    """``key_map`` as one function (a ConfigError for anything that is neither form)."""
    if key_map is None:
        return lambda key: key
    if callable(key_map):
        return key_map
    if isinstance(key_map, Mapping):
        try:
            rules = [(re.compile(p), r) for p, r in key_map.items()]
        except (re.error, TypeError) as exc:
            raise ConfigError(
                f"key_map has a pattern that is not a regular expression: {exc}",
                fix="key_map={r'^old\\.': 'new.'} (patterns -> replacements), or a function.",
            ) from None

        def rename(key: str) -> str:
            for pattern, replacement in rules:
                new, n = pattern.subn(replacement, key)
                if n:
                    return new
            return key

        return rename
    raise ConfigError(
        f"key_map={type(key_map).__name__} is neither a function nor a mapping",
        fix="pass key_map=lambda name: name.replace('old.', 'new.') or {r'^old\\.': 'new.'}.",
    )


def candidates(key: str, prefix: str | None) -> list[str]:
    """Model names ``key`` may stand for, the likeliest first (the name itself)."""
    out = [key]
    for wrapper in WRAPPER_PREFIXES:
        if key.startswith(wrapper):
            out.append(key[len(wrapper) :])
    if prefix:
        head = f"{prefix}."
        out += [k[len(head) :] for k in list(out) if k.startswith(head)]
        out += [head + k for k in list(out) if not k.startswith(head)]
    return out


def resolve(
    file_keys: Iterable[str],
    model_keys: Collection[str],
    *,
    key_map: KeyMap = None,
    prefix: str | None = None,
    ignore: Iterable[str] = (),
) -> Resolution:
    """Match the file's names to the model's (see the module text). ``ignore``: regular
    expressions of file names that may be left over silently (HF's
    ``_keys_to_ignore_on_load_unexpected``, e.g. GPT-2's old ``attn.bias`` masks)."""
    rename = rename_function(key_map)
    chosen: dict[str, str] = {}
    renamed, skipped = {}, []
    for key in file_keys:
        new = rename(key)
        if new is None:
            skipped.append(key)
        elif not isinstance(new, str):
            raise ConfigError(
                f"key_map({key!r}) returned {type(new).__name__}, not a name",
                fix="return the model's name for the tensor (a str), or None to skip it.",
            )
        else:
            renamed[key] = new
    used: set[str] = set()
    for exact_only in (True, False):  # exact names claim first, prefix rules fill the rest
        for key, new in renamed.items():
            if key in used:
                continue
            options = [new] if exact_only else candidates(new, prefix)[1:]
            hit = next((m for m in options if m in model_keys and m not in chosen), None)
            if hit is not None:
                chosen[hit] = key
                used.add(key)
    patterns = [re.compile(p) for p in ignore]
    unexpected = [k for k in renamed if k not in used and not any(p.search(k) for p in patterns)]
    return Resolution(chosen, unexpected, skipped)
