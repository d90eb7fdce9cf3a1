"""Tensor parallelism without processes: the slicing rule, the plan's matching and its errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.errors import ConfigError
from rankwise.models import GPT, GPT_PLAN, GPTConfig
from rankwise.parallel import tensor as tp
from rankwise.parallel.tensor.shards import check_divisible, shard, unshard

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def test_a_fused_split_gives_each_rank_its_slice_of_every_block():
    full = torch.arange(12).view(12, 1)  # blocks [0..3], [4..7], [8..11]
    assert shard(full, 0, 1, 2, chunks=3).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert shard(full, 0, 0, 2).flatten().tolist() == [0, 1, 2, 3, 4, 5]
    for chunks in (1, 3):
        pieces = [shard(full, 0, r, 2, chunks) for r in range(2)]
        assert torch.equal(unshard(pieces, 0, chunks), full)
    cols = torch.arange(8).view(2, 4)
    assert torch.equal(unshard([shard(cols, 1, r, 4) for r in range(4)], 1), cols)


def test_an_uneven_split_names_the_value_and_the_padding_fix():
    with pytest.raises(ConfigError, match=r"(?s)num_embeddings=50257 .* group of 2 .*50304"):
        check_divisible("num_embeddings", 50257, 2)


def test_a_plan_at_one_rank_leaves_the_model_computing_the_same():
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, 64, (2, 8))
    want, _ = model(idx)
    tp.tensor_parallel(model, GPT_PLAN)
    assert isinstance(model.blocks[1].attn.qkv, tp.ColumnParallelLinear)
    assert isinstance(model.blocks[0].mlp.proj, tp.RowParallelLinear)
    assert model.lm_head.weight is model.wte.weight
    assert torch.allclose(model(idx)[0], want, atol=1e-6)


def test_pattern_star_matches_one_segment_and_a_typo_is_refused():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"'\*\.1' matches no module"):
        tp.tensor_parallel(model, {"*.1": "column"})  # '*' does not cross the dot into 0.0
    with pytest.raises(ConfigError, match=r"'column' splits an nn.Linear, but 0 is a Sequential"):
        tp.tensor_parallel(model, {"0": "column"})
    with pytest.raises(ConfigError, match="style 'colum'"):
        tp.tensor_parallel(model, {"1": "colum"})
    tp.tensor_parallel(model, {"*.0": "row"})
    assert isinstance(model[0][0], tp.RowParallelLinear) and isinstance(model[1], nn.Linear)


def test_divide_adjusts_a_stored_head_count_or_names_it():
    attn = nn.Module()
    attn.n_head, attn.n_embd = 6, 48
    tp.Divide("n_head", "n_embd").apply(attn, "attn", None, {}, False)  # group size 1
    assert (attn.n_head, attn.n_embd) == (6, 48)
    attn.n_head = "six"
    with pytest.raises(ConfigError, match=r"attn.n_head='six'"):
        tp.Divide("n_head").apply(attn, "attn", None, {}, False)


def test_full_state_round_trips_at_one_rank():
    torch.manual_seed(0)
    model = tp.tensor_parallel(GPT(CFG), GPT_PLAN)
    state = tp.full_state_dict(model)
    assert state["blocks.0.attn.qkv.weight"].shape == (96, 32)
    other = tp.tensor_parallel(GPT(CFG), GPT_PLAN)
    tp.load_full_state_dict(other, state)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )


def test_a_slice_does_not_keep_the_full_weight_alive():
    full = torch.zeros(8, 4)
    piece = shard(full, 0, 1, 2)  # rows 4..7: contiguous, so a view would have been possible
    assert piece.untyped_storage().nbytes() == 4 * 4 * 4
