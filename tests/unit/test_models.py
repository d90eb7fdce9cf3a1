"""The recipe models (rankwise.models): shapes, tied weights, generation, parameter groups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rankwise.errors import ConfigError
from rankwise.models import GPT, GPTConfig, param_groups, resnet18


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16, **kw))


def test_gpt_loss_is_next_token_cross_entropy_and_attention_is_causal():
    model = _gpt()
    idx = torch.randint(0, 20, (3, 8))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert logits.shape == (3, 7, 20)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 20), idx[:, 1:].reshape(-1)))
    # Changing the last token leaves every earlier position's logits unchanged.
    other = idx.clone()
    other[:, -1] = (other[:, -1] + 1) % 20
    assert torch.equal(model(idx)[0][:, :-1], model(other)[0][:, :-1])
    assert not torch.equal(model(idx)[0][:, -1], model(other)[0][:, -1])


def test_gpt_embedding_is_tied_and_listed_once_in_the_groups():
    model = _gpt()
    assert model.lm_head.weight is model.wte.weight
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each once, all of them
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])


def test_generate_appends_tokens_and_crops_to_the_block():
    model = _gpt().eval()
    g = torch.Generator().manual_seed(0)
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), 12, top_k=5, generator=g)
    assert out.shape == (2, 15) and out.max() < 20
    assert torch.equal(out[:, :3], torch.zeros(2, 3, dtype=torch.long))
    # top_k=1 is greedy: the same continuation whatever the generator.
    a = model.generate(torch.zeros(1, 1, dtype=torch.long), 5, top_k=1)
    b = model.generate(torch.zeros(1, 1, dtype=torch.long), 5, top_k=1, generator=g)
    assert torch.equal(a, b)


def test_qkv_bias_false_drops_only_the_qkv_bias():
    attn = _gpt(qkv_bias=False).blocks[0].attn
    assert attn.qkv.bias is None and attn.proj.bias is not None
    assert _gpt(bias=False, qkv_bias=True).blocks[0].attn.qkv.bias is None  # bias=False: none


def test_gpt_config_and_overlong_input_name_the_values():
    with pytest.raises(ConfigError, match=r"n_embd=30, n_head=4"):
        GPTConfig(vocab_size=10, n_embd=30, n_head=4)
    with pytest.raises(ConfigError, match="9 tokens; its block_size is 8"):
        _gpt()(torch.zeros(1, 9, dtype=torch.long))


def test_resnet18_layout_and_residual_blocks_start_as_identity():
    model = resnet18(num_classes=10, width=4)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    blocks = [m for m in model.modules() if type(m).__name__ == "BasicBlock"]
    assert len(blocks) == 8  # ResNet-18: four stages of two
    assert [b.body[0].out_channels for b in blocks[::2]] == [4, 8, 16, 32]
    first = blocks[0].eval()  # same shape in and out: zero-initialised last norm -> relu(x)
    x = torch.randn(1, 4, 8, 8)
    assert torch.equal(first(x), torch.relu(x))
