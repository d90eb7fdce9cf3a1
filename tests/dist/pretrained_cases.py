"""The pretrained-weights tests' models, files and per-rank comparisons (test_pretrained_dist).

Every "pretrained" file is written here from a model built from a config (no download):
Hugging Face's own ``save_pretrained`` for GPT-2 and Llama (one file, and shards with an index),
``safetensors.torch.save_model`` for the GPTs of ``rankwise.models`` and
``rankwise.parallel.tensor.tiny_gpt``. The comparisons are made per rank on what the rank
holds (ZeRO's flat shards, the tensor-parallel pieces): bitwise.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

GPT2 = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
            eos_token_id=0)  # fmt: skip
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
             bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)  # fmt: skip
LLAMA_PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
    "lm_head": "column",
}
SHARD = "20KB"
"""Small enough that the tiny models' checkpoints are several files with an index."""


def quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    quiet()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**GPT2))


def llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet()
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA))


def nano(seed: int) -> nn.Module:
    from rankwise.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def tiny(seed: int) -> nn.Module:
    import mesh_cases as mc

    from rankwise.parallel.tensor.tiny_gpt import GPT

    torch.manual_seed(seed)
    return GPT(mc.CFG)


def write_files(folder: Path) -> None:
    """The checkpoints every case reads (seed 0 models); the loading models use seed 1."""
    from safetensors.torch import save_model

    gpt2(0).save_pretrained(folder / "gpt2")
    gpt2(0).save_pretrained(folder / "gpt2-sharded", max_shard_size=SHARD)
    llama(0).save_pretrained(folder / "llama-sharded", max_shard_size=SHARD)
    save_model(nano(0), str(folder / "nano.safetensors"))
    save_model(tiny(0), str(folder / "tiny.safetensors"))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    from rankwise.models import param_groups

    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-2)


def held(model: nn.Module) -> list[torch.Tensor]:
    """What this rank keeps of ``model``: ZeRO's flat shards and the tensors outside them
    (buffers, frozen parameters), or, without ZeRO, every tensor of the bare model (a
    tensor-parallel piece where split)."""
    from rankwise.checkpoint.state_dict import registered_inner

    bare = registered_inner(model)
    units = getattr(model, "units", None)
    if units is None:
        return [t.detach().clone() for t in bare.state_dict().values()]
    inside = {id(p) for u in units for p in u.params}
    rest = [p for p in bare.parameters() if id(p) not in inside] + list(bare.buffers())
    return [u.shard.detach().clone() for u in units] + [t.detach().clone() for t in rest]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bitwise equal, tensor by tensor (dtype and shape included)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def numpy_state(state: dict) -> dict:
    return {k: v.detach().cpu().clone().numpy() for k, v in state.items()}


def file_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or index folder, read by safetensors alone."""
    import json

    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if path.is_file():
        return load_file(str(path))
    if not index.exists():
        return load_file(str(path / "model.safetensors"))
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out = {}
    for name in names:
        out.update(load_file(str(path / name)))
    return out
