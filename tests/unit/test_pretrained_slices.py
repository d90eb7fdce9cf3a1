"""The slice arithmetic and the name matching of ``rw.load_pretrained`` (pure, no files).

``copy_range`` must produce exactly what slicing the whole tensor would (``parallel/tensor``'s
own ``shard``, then the flat range ZeRO-3 keeps), while reading only the rows the range
touches; ``resolve`` must pair a file's names with a model's as ``from_pretrained`` does.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwise.checkpoint.pretrained.keys import resolve
from rankwise.checkpoint.pretrained.slices import Split, copy_range, shard_overlap
from rankwise.errors import ConfigError
from rankwise.parallel.tensor.shards import shard


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    split = None
    if draw(st.booleans()):
        dim = draw(st.integers(0, ndim - 1))
        size, chunks = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 3]))
        shape[dim] *= size * chunks
        split = Split(dim, chunks, draw(st.integers(0, size - 1)), size)
    local = list(shape)
    if split is not None:
        local[split.dim] //= split.size
    n = math.prod(local)
    a = draw(st.integers(0, n))
    return shape, split, a, draw(st.integers(a, n))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_copy_range_is_the_flat_range_of_this_ranks_piece_and_reads_only_its_rows(case):
    shape, split, a, b = case
    full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    piece = full if split is None else shard(full, split.dim, split.rank, split.size, split.chunks)
    asked = []

    def read(index):
        out = full[index]
        asked.append(out.numel())
        return out

    out = torch.full((b - a,), -1.0, dtype=torch.float32)  # converted on the way
    count = copy_range(read, shape, split, a, b, out)
    assert torch.equal(out, piece.reshape(-1)[a:b].float())
    assert count == sum(asked)
    row = math.prod(piece.shape[1:])
    assert count <= (b - a) + 2 * row if b > a else count == 0  # the range + 2 partial rows


def test_shard_overlap_names_the_part_of_a_parameter_in_the_shard():
    assert shard_overlap(offset=10, numel=20, lo=0, hi=16) == (0, 6)
    assert shard_overlap(offset=10, numel=20, lo=16, hi=32) == (6, 20)
    a, b = shard_overlap(offset=10, numel=5, lo=16, hi=32)
    assert a >= b  # none of it


MODEL = ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "lm_head.weight"]


def test_a_base_models_file_gets_the_prefix_and_a_task_models_file_loses_it():
    base = resolve(["wte.weight", "h.0.attn.c_attn.weight"], MODEL, prefix="transformer")
    assert base.chosen == {"transformer.wte.weight": "wte.weight",
                           "transformer.h.0.attn.c_attn.weight": "h.0.attn.c_attn.weight"}  # fmt: skip
    task = resolve(["transformer.wte.weight", "lm_head.weight"], ["wte.weight"],
                   prefix="transformer")  # fmt: skip
    assert task.chosen == {"wte.weight": "transformer.wte.weight"}
    assert task.unexpected == ["lm_head.weight"]


def test_exact_names_win_wrappers_are_dropped_and_ignored_names_are_not_unexpected():
    got = resolve(
        ["module.transformer.wte.weight", "wte.weight", "transformer.wte.weight", "h.0.attn.bias"],
        MODEL, prefix="transformer", ignore=[r"attn\.bias"],
    )  # fmt: skip
    assert got.chosen["transformer.wte.weight"] == "transformer.wte.weight"
    assert sorted(got.unexpected) == ["module.transformer.wte.weight", "wte.weight"]


def test_key_map_as_a_function_or_as_patterns():
    renamed = resolve(["old.wte", "skip.me"], ["new.wte"],
                      key_map=lambda k: None if k.startswith("skip") else k.replace("old", "new"))  # fmt: skip
    assert renamed.chosen == {"new.wte": "old.wte"} and renamed.skipped == ["skip.me"]
    patterns = resolve(["gpt.h.0.w", "gpt.h.1.w"], ["h.0.w", "h.1.w"], key_map={r"^gpt\.": ""})
    assert patterns.chosen == {"h.0.w": "gpt.h.0.w", "h.1.w": "gpt.h.1.w"}


@pytest.mark.parametrize("bad", [42, {"(": "x"}, lambda k: 3])
def test_a_key_map_of_the_wrong_kind_is_refused(bad):
    with pytest.raises(ConfigError, match="key_map"):
        resolve(["a"], ["a"], key_map=bad)
