"""Models built on the meta device, initialised by ``rt.prepare`` (docs/zero.md, "Models larger
than one process"), under every registered strategy:

- ``exact_init=True``: the prepared model equals an eager build at the same seed bit for bit,
  after prepare and after 3 AdamW steps (rankwise.models.GPT with its tied head and decay
  groups, and a model of torch's own layers), and the random generator is left where the eager
  build left it; ranks seeded differently are refused, naming the ranks;
- default initialisation: every tensor set (no NaN), kaiming-uniform and N(0, 1) weights with
  their distributions, BatchNorm statistics and computed buffers (a causal mask, a rotary
  table) as an eager build has them, values from rank 0's random state whatever each rank's
  seed, and each rank's own generator left as it was; the model trains;
- the errors: a module without ``reset_parameters()``, an ``init=`` that leaves a tensor unset,
  ``init=`` for a model that is not on the meta device.
"""

from __future__ import annotations

import math

import meta_cases as mc
import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

MULTI = ["ddp", "zero1", "zero2", "zero3"]


def _check_pair(result: dict) -> None:
    assert result["same_rng"]
    assert result["before"] == [] and result["after"] == []
    eager, meta = result["losses"]
    assert eager == meta and all(math.isfinite(v) for v in meta)
    assert result["moved"] == result["params"]  # every parameter trained


def _check_default(facts: dict) -> None:
    assert facts["rng_kept"] and facts["rank0"] == [] and facts["nan"] == []
    within_bound, std_ratio = facts["kaiming"]
    assert within_bound and 0.95 < std_ratio < 1.05, facts["kaiming"]
    assert 0.95 < facts["normal"] < 1.05
    assert facts["bn"] == (0.0, 1.0, 1.0, 0)
    assert facts["mask"] and facts["freqs"]
    assert all(math.isfinite(v) for v in facts["losses"])


@pytest.mark.parametrize("strategy", MULTI)
def test_meta_model_equals_eager_build_and_default_init_is_sound(strategy):
    ranks = run_distributed(mc.every_check, 2, args=(strategy,), init=False, timeout=240)
    for result in ranks:
        _check_pair(result["gpt"])
        _check_pair(result["plain"])
        _check_default(result["default"])
        assert "exact_init=True" in result["refused"] and "[1]" in result["refused"]
        assert "torch.manual_seed" in result["refused"]


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_meta_model_in_one_process(strategy):
    devices = {"devices": ["cpu", "cpu"]} if strategy == "dp" else {}
    rt = rw.init(strategy=strategy, **devices)
    _check_pair(mc._pair(rt, "gpt"))
    _check_pair(mc._pair(rt, "plain"))
    _check_default(mc.default_mode(rt))


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_errors_name_the_module_and_the_fix():
    rt = rw.init(strategy="single")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    with pytest.raises(rw.ConfigError) as err:
        rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    text = str(err.value)
    assert "'1' (NoReset)" in text and "'scale'" in text
    assert "reset_parameters()" in text and "init=fn" in text

    def half(module: nn.Module) -> None:  # sets the weight, forgets the bias
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(rw.ConfigError, match=r"module '0' \(Linear\) left parameter 'bias'"):
        rt.prepare(model, init=half)
    with pytest.raises(rw.ConfigError, match="init= was given, but the model has no tensor"):
        rt.prepare(nn.Linear(2, 2), init=half)
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(rw.ConfigError, match="init=3 is not callable"):
        rt.prepare(model, init=3)


def test_init_function_and_tensor_parallel_pieces_in_one_process():
    """``init=`` runs per module as ``model.apply`` would (children first, then each parent with meta tensors below it); a tensor-parallel plan applied to a
    meta model cuts its pieces at prepare (a group of one keeps them whole)."""
    from rankwise.models import GPT, GPT_PLAN, GPTConfig

    rt = rw.init(strategy="single")
    seen = []

    def init(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)
        if hasattr(module, "reset_running_stats"):
            module.reset_running_stats()

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.BatchNorm1d(3))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # state made at construction
    model, opt = rt.prepare(model, opt, init=init)
    # a dry run on the meta device (which tensors each call writes), then the real calls
    assert seen == ["Linear", "BatchNorm1d", "Sequential"] * 2
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())
    model(torch.randn(4, 2)).sum().backward()
    opt.step()  # the optimizer given to prepare steps the real parameters (its state remade)
    assert torch.equal(model[2].bias, torch.full_like(model[2].bias, 0.5 - 0.1))

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(3)
    eager = rw.tensor_parallel(GPT(cfg), GPT_PLAN)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = rw.tensor_parallel(GPT(cfg), GPT_PLAN)
    meta = rt.prepare(meta, exact_init=True)
    assert meta.lm_head.weight is meta.wte.weight  # the tie survives
    assert mc.differing(eager.state_dict(), meta.state_dict()) == []


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_meta_model_on_a_data_2_by_tensor_2_mesh_equals_eager(strategy):
    """``rw.tensor_parallel`` on a meta model keeps each rank's pieces to cut at prepare: the
    split model equals the eagerly built and split one, after prepare and after 3 AdamW steps
    (4 ranks; the data dimension under our DDP, then ZeRO-3)."""
    for r in run_distributed(mc.mesh_pair, 4, args=(strategy,), init=False, timeout=300):
        assert r["differ"] == [[]] * (mc.STEPS + 1)
        assert r["moved"]  # it trained


@pytest.mark.gpu
def test_meta_model_built_on_cuda():
    """Default mode builds on the device (its generator); exact mode on the CPU, then moves."""
    rt = rw.init(strategy="single", device="cuda")
    torch.manual_seed(mc.SEED)
    eager = mc.build("gpt").cuda()
    torch.manual_seed(mc.SEED)
    with torch.device("meta"):
        meta = mc.build("gpt")
    meta = rt.prepare(meta, exact_init=True)
    assert mc.differing(eager.state_dict(), meta.state_dict()) == []
    with torch.device("meta"):
        checked = mc.Checked()
    checked = rt.prepare(checked)
    assert all(t.is_cuda and not t.isnan().any() for t in checked.state_dict().values()
               if t.is_floating_point())  # fmt: skip
