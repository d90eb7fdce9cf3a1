"""Hugging Face models built eagerly and on the meta device, for the init-order tests
(imported by the spawned ranks too). Built from tiny configs: nothing is downloaded.

Every randomly initialised tensor has at least ``MIN_RANDOM`` elements, so a sample standard
deviation is within 1/sqrt(2n) <= 0.6% of the true one (one standard error), and the ratio of
two independent ones within 0.8%: the tests' 5% bound is over 6 standard errors, while the
bug it guards (GPT-2's residual projections left at 0.02 instead of 0.02/sqrt(2 n_layer))
is a factor 2.8.
"""

from __future__ import annotations

import torch

import rankwise as rw

MIN_RANDOM = 16384


def build(name: str):
    """A fresh model (eager, or on the meta device under ``with torch.device("meta")``)."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=128, n_embd=128,
                                          n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0))  # fmt: skip
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg)


def tensors(model) -> dict[str, torch.Tensor]:
    """Every floating parameter and buffer, whole, by name (buffers not saved included)."""
    found = [*model.named_parameters(), *model.named_buffers()]
    return {k: v.detach().float().cpu().clone() for k, v in found if v.is_floating_point()}


def meta_prepared(name: str, strategy: str = "zero3", exact: bool = False) -> dict:
    """The model built on the meta device and initialised by ``rt.prepare`` with the model's
    own ``_init_weights`` (runs on every rank; ``state_dict`` gathers the shards)."""
    rt = rw.init(strategy=strategy)
    torch.set_num_threads(1)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, _ = rt.prepare(model, opt, init=model._init_weights, exact_init=exact)
    with rt.full_parameters(prepared) as bare:  # every unit gathered (all ranks)
        return tensors(bare)
