"""Tensor-parallel layers and a whole GPT block equal the unsplit modules (2 Gloo ranks).

One spawned job runs every case (each rank checks its own slice against the unsplit module it
also builds) and returns the largest differences; fp32, tolerance 1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from tp_cases import compare, max_diff, twins

from rankwise.errors import ConfigError
from rankwise.models import GPT, GPT_PLAN, Block, GPTConfig
from rankwise.parallel import tensor as tp
from rankwise.testing import run_distributed

TOL = 1e-5
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)


def _square(out: torch.Tensor) -> torch.Tensor:
    # A loss that weighs every output element differently, so a wrong slice shows.
    weights = torch.linspace(0.5, 1.5, out.numel()).view_as(out)
    return (out * out * weights).sum()


def _layer_cases() -> dict[str, dict]:
    torch.manual_seed(1)
    x = torch.randn(3, 4, 16)
    res = {}
    ref, twin = twins(nn.Linear(16, 12))
    res["column gathered"] = compare(
        ref, tp.ColumnParallelLinear(twin, gather_output=True), x, _square, _square
    )
    ref, twin = twins(nn.Linear(16, 24))
    res["column chunks=3 gathered"] = compare(
        ref, tp.ColumnParallelLinear(twin, chunks=3, gather_output=True), x, _square, _square
    )
    ref, twin = twins(nn.Linear(16, 10))
    res["row, whole input"] = compare(
        ref, tp.RowParallelLinear(twin, input_is_parallel=False), x, _square, _square
    )
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    ref, twin = twins(mlp)
    twin[0], twin[2] = tp.ColumnParallelLinear(twin[0]), tp.RowParallelLinear(twin[2])
    res["column + row pair"] = compare(ref, twin, x, _square, _square)
    ids = torch.randint(0, 32, (3, 5))
    ref, twin = twins(nn.Embedding(32, 8))
    res["vocab embedding"] = compare(ref, tp.VocabParallelEmbedding(twin), ids, _square, _square)
    return res


def _loss_case() -> dict:
    torch.manual_seed(2)
    full = torch.randn(4, 6, 32, requires_grad=True)
    target = torch.randint(0, 32, (4, 6))
    target[0, :2] = -100  # ignored positions
    rank = torch.distributed.get_rank()
    mine = full.detach()[..., rank * 16 : (rank + 1) * 16].clone().requires_grad_()
    want = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100)
    got = tp.vocab_parallel_cross_entropy(mine, target)
    want.backward()
    got.backward()
    return {
        "loss": abs(want.item() - got.item()),
        "logits.grad": max_diff(full.grad[..., rank * 16 : (rank + 1) * 16], mine.grad),
    }


def _gpt_cases() -> dict[str, dict]:
    torch.manual_seed(3)
    res = {}
    block = Block(CFG)
    ref, twin = twins(block)
    plan = {k.removeprefix("blocks.*."): v for k, v in GPT_PLAN.items() if k.startswith("blocks")}
    tp.tensor_parallel(twin, plan)
    res["GPT block"] = compare(ref, twin, torch.randn(2, 8, 16), _square, _square)
    ref, twin = twins(GPT(CFG))
    tp.tensor_parallel(twin, GPT_PLAN)
    ids = torch.randint(0, 32, (2, 8))
    target = torch.randint(0, 32, (2, 8))
    rank = torch.distributed.get_rank()
    res["GPT + vocab-parallel loss"] = compare(
        ref, twin, ids,
        lambda out: F.cross_entropy(out.flatten(0, 1), target.flatten()),
        lambda out: tp.vocab_parallel_cross_entropy(out, target),
        out_view=lambda out: out[..., rank * 16 : (rank + 1) * 16],
    )  # fmt: skip
    _, want = ref(ids, target)  # the model's own loss: vocab-parallel once the head is split
    _, got = twin(ids, target)
    res["GPT(ids, targets) loss"] = {"loss": abs(want.item() - got.item())}
    res["shapes"] = {
        "qkv": tuple(twin.blocks[0].attn.qkv.weight.shape),
        "tied": twin.lm_head.weight is twin.wte.weight,
        "generate": _refusal(lambda: twin.generate(ids, 1)),  # a slice cannot be sampled
    }
    return res


def _refusal(call) -> str:
    try:
        call()
    except ConfigError as exc:
        return str(exc)
    return "not refused"


def _sequence_parallel_case() -> dict:
    """LayerNorm -> column -> GELU -> row with the activations split along the sequence."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    ref, twin = twins(net)
    twin[1] = tp.ColumnParallelLinear(twin[1], sequence_parallel=True)
    twin[3] = tp.RowParallelLinear(twin[3], sequence_parallel=True)
    x = torch.randn(2, 6, 16)
    rank = torch.distributed.get_rank()
    mine = slice(rank * 3, (rank + 1) * 3)
    x_ref, x_tp = x.clone().requires_grad_(), x[:, mine].clone().requires_grad_()
    out_ref, out_tp = ref(x_ref), twin(x_tp)
    _square(out_ref).backward()
    # This rank's tokens with the same weights as in the whole loss.
    w = torch.linspace(0.5, 1.5, out_ref.numel()).view_as(out_ref)[:, mine]
    (out_tp * out_tp * w).sum().backward()
    tp.sync_replicated_grads(twin)
    return {
        "output": max_diff(out_ref[:, mine], out_tp),
        "input.grad": max_diff(x_ref.grad[:, mine], x_tp.grad),
        "layernorm.grad": max_diff(ref[0].weight.grad, twin[0].weight.grad),
        "row bias.grad": max_diff(ref[3].bias.grad, twin[3].bias.grad),
        "column weight.grad": max_diff(
            ref[1].weight.grad[rank * 16 : (rank + 1) * 16], twin[1].weight.grad
        ),
    }


def _all_cases():
    return {
        **_layer_cases(),
        "vocab-parallel cross-entropy": _loss_case(),
        **_gpt_cases(),
        "sequence parallel pair": _sequence_parallel_case(),
    }


def test_tensor_parallel_layers_and_gpt_equal_the_unsplit_modules():
    results = run_distributed(_all_cases, 2, timeout=180)
    for rank, cases in enumerate(results):
        shapes = cases.pop("shapes")
        assert "head holds 16 of 32 tokens" in shapes.pop("generate")
        assert shapes == {"qkv": (24, 16), "tied": True}  # half of [q; k; v], still tied
        for case, diffs in cases.items():
            worst = max(diffs.values())
            assert worst <= TOL, f"rank {rank}, {case}: {diffs}"
        assert len(cases["GPT block"]) >= 12  # output, input grad, and every parameter's grad
