"""A zero3 model keeps the user's own methods and attributes, as FSDP2's ``fully_shard`` does
(world 2, Gloo): a tiny Hugging Face GPT-2 built from a config (no download)

- ``model.generate(...)`` (greedy) equals the unsharded model's, on every rank, without
  ``rt.full_parameters``; so does ``rankwise.models.GPT``'s own ``generate``, on a meta-built
  model initialised by ``rt.prepare``; a meta-built GPT-2 takes Hugging Face's own
  initialisation through ``init=model._init_weights``;
- ``model.config`` is the model's own object; ``model.save_pretrained(dir)``, called on every
  rank, writes (on rank 0, as Hugging Face does under torch.distributed) a checkpoint that
  ``from_pretrained`` loads back to the unsharded model's weights (tied head included);
- ``model.state_dict()`` is the full state on every rank, and the units are freed again after
  each of these (each rank's resident parameters are its shards);
- ``isinstance(model, rw.ShardedDataParallel)``, ``rt.full_parameters(model)`` still work,
  ``model.module`` is still refused outside it.
"""

from __future__ import annotations

import torch

import rankwise as rw
from rankwise.models import GPT, GPTConfig
from rankwise.testing import run_distributed


def _gpt2(seed: int | None):
    from transformers import GPT2Config, GPT2LMHeadModel

    if seed is not None:
        torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).eval()


def _meta_gpt2(rt) -> dict:
    """Hugging Face's own initialisation on a meta-built GPT-2: ``init=model._init_weights``."""
    with torch.device("meta"):
        hf = _gpt2(None)
    model, _ = rt.prepare(hf, torch.optim.AdamW(hf.parameters()), init=hf._init_weights)
    state = model.state_dict()
    text = model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return {"nan": [k for k, v in state.items() if v.is_floating_point() and v.isnan().any()],
            "std": float(state["transformer.h.0.attn.c_attn.weight"].std()),
            "tied": hf.lm_head.weight is hf.transformer.wte.weight, "shape": tuple(text.shape)}  # fmt: skip


PROMPT = torch.tensor([[1, 5, 9], [2, 2, 7]])


def _unit_bytes(model) -> int:
    return sum(u.full.untyped_storage().nbytes() for u in model.units)


def _ranks(out_dir: str) -> dict:
    rt = rw.init(strategy="zero3")
    torch.set_num_threads(1)
    hf = _gpt2(0)
    model, _ = rt.prepare(hf, torch.optim.AdamW(hf.parameters(), lr=1e-3))
    text = model.generate(PROMPT, max_new_tokens=5, do_sample=False, pad_token_id=0)
    freed = _unit_bytes(model)
    path = f"{out_dir}/gpt2"
    model.save_pretrained(path)  # every rank (the state is gathered); Hugging Face writes on rank 0
    state = model.state_dict()
    freed += _unit_bytes(model)
    with rt.full_parameters(model) as bare:
        inside = bare.generate(PROMPT, max_new_tokens=5, do_sample=False, pad_token_id=0)
    try:
        refused = model.module is None
    except rw.ConfigError:
        refused = True
    with torch.device("meta"):
        gpt = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    torch.manual_seed(5)
    small, _ = rt.prepare(gpt, torch.optim.AdamW(gpt.parameters()), exact_init=True)
    own = small.generate(torch.zeros(1, 2, dtype=torch.long), 6, top_k=1)
    return {"hf_meta": _meta_gpt2(rt),
        "text": text, "inside": inside, "path": path, "state": state, "freed": freed,
        "config": model.config is hf.config and model.config.n_embd == 32, "sharded": isinstance(model, rw.ShardedDataParallel),
        "refused": refused, "own": own, "small_state": small.state_dict(),
    }  # fmt: skip


def test_zero3_model_answers_generate_config_and_save_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    want = _gpt2(0)
    text = want.generate(PROMPT, max_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.manual_seed(5)
    small = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    own = small.generate(torch.zeros(1, 2, dtype=torch.long), 6, top_k=1)
    for r in run_distributed(_ranks, 2, args=(str(tmp_path),), init=False, timeout=300):
        assert torch.equal(r["text"], text) and torch.equal(r["inside"], text)
        assert r["config"]
        assert r["sharded"] and r["refused"] and r["freed"] == 0
        for key, value in want.state_dict().items():
            assert torch.equal(r["state"][key], value), key
        loaded = GPT2LMHeadModel.from_pretrained(r["path"])
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
        for key, value in want.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key
        assert torch.equal(r["own"], own)
        hf_meta = r["hf_meta"]  # N(0, 0.02) from Hugging Face's _init_weights, every tensor set
        assert hf_meta["nan"] == [] and 0.018 < hf_meta["std"] < 0.022 and hf_meta["tied"]
        assert hf_meta["shape"] == (2, 6)
        for key, value in small.state_dict().items():
            assert torch.equal(r["small_state"][key], value), key
