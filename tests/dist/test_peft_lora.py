"""LoRA fine-tuning with peft under every data-parallel engine equals one process.

A HF GPT-2 (built from a config, no download) gets peft's LoRA adapters on its attention and
projection layers (c_attn, attn and mlp c_proj: 12 adapter matrices; ``get_peft_model``: the base weights frozen, ``init_lora_weights=False`` so
both adapter matrices start nonzero and both train). Two ranks, each on its half of every
global batch, train the adapters for 3 AdamW steps under ``rw.DistributedDataParallel`` and
``rw.ShardedDataParallel`` stages 1-3; every adapter weight must equal one process trained on
the whole batches (to 1e-6), and the frozen base weights must not move.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rankwise as rw
from rankwise.testing import run_distributed

pytest.importorskip("peft")
pytest.importorskip("transformers")

ENGINES = ("ddp", "zero1", "zero2", "zero3")
PER_RANK, STEPS, TOL = 4, 3, 1e-6


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                      fan_in_fan_out=True, init_lora_weights=False)  # fmt: skip
    return get_peft_model(GPT2LMHeadModel(cfg), lora)


def _batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (world * PER_RANK, 16), generator=g) for _ in range(STEPS)]


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2)


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _oracle() -> tuple[dict, dict]:
    model = _model()
    before = _weights(model)
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    for ids in _batches(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return before, _weights(model)


def _train(engine: str) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    if engine == "ddp":
        wrapped = rw.DistributedDataParallel(model)
        opt = _adamw([p for p in model.parameters() if p.requires_grad])
    else:
        wrapped = rw.ShardedDataParallel(model, _adamw, stage=int(engine[-1]))
        opt = wrapped.optimizer
    for ids in _batches(world):
        mine = ids[rank * PER_RANK : (rank + 1) * PER_RANK]
        wrapped(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()
    if engine == "zero3":
        with wrapped.full_parameters():
            return _weights(model)
    return _weights(model)


def _every_engine() -> dict:
    return {engine: _train(engine) for engine in ENGINES}


@pytest.mark.timeout(300)
def test_lora_adapters_train_as_in_one_process_under_every_engine():
    before, want = _oracle()
    adapters = [n for n in want if "lora_" in n]
    assert len(adapters) == 12 and all(not torch.equal(before[n], want[n]) for n in adapters)
    for rank, by_engine in enumerate(run_distributed(_every_engine, 2, timeout=240)):
        for engine, got in by_engine.items():
            assert set(got) == set(want), engine
            for name, value in got.items():
                diff = (value - want[name]).abs().max().item()
                assert diff <= TOL, f"rank {rank} {engine} {name}: {diff:.3g}"
                if name not in adapters:  # frozen base weights stay as built
                    assert torch.equal(value, before[name]), (rank, engine, name)
