"""A meta-built model is initialised in its own order (docs/zero.md, "Models larger than one
process"): ``model.apply``'s, children before their parent, so a parent's initialisation that
overrides a child's wins, as in an eager build.

- Hugging Face GPT-2 (4 layers: residual projections at 0.02/sqrt(8)) and Llama, built on the
  meta device and prepared under ``zero3`` at world 1 and 2 with ``init=model._init_weights``,
  match an eager build tensor by tensor: every random tensor's standard deviation within 5%
  (sample sizes in ``init_order_cases``), every constant tensor (norms, biases) and computed
  buffer (Llama's rotary table) equal;
- a parent that sets its child's weight wins over the child's own initialisation, a child that
  writes its parent's tensor before the parent's turn is not lost, and a parent whose
  initialisation cannot run on the meta device still sees and sets its children's values
  (world 2, ``zero3``: the units keep only final values);
- ``exact_init=True`` warns when the model initialises in a second pass (it cannot be exact);
  default initialisation warns that such a pass is skipped.
"""

from __future__ import annotations

import init_order_cases as ioc
import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed


def _compare(
    eager: dict[str, torch.Tensor], other: dict[str, torch.Tensor], meta: dict[str, torch.Tensor]
) -> list[str]:
    """Names of tensors whose distribution differs (see the module text); ``other``: an eager
    build at another seed (a tensor equal in both is computed, not drawn: it must be equal)."""
    assert eager.keys() == meta.keys()
    bad = []
    for name, want in eager.items():
        got = meta[name]
        if torch.equal(want, other[name]):  # ones, zeros, a rotary table
            if not torch.equal(got, want):
                bad.append(name)
            continue
        assert want.numel() >= ioc.MIN_RANDOM, f"{name}: too few elements for a stable std"
        ratio = float(got.std()) / float(want.std())
        if not 0.95 < ratio < 1.05:
            bad.append(f"{name}: std {float(got.std()):.5f} vs eager {float(want.std()):.5f}")
    return bad


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_meta_built_hf_model_matches_eager_distributions(name, world):
    torch.manual_seed(0)
    eager = ioc.tensors(ioc.build(name))
    torch.manual_seed(1)
    other = ioc.tensors(ioc.build(name))
    if name == "gpt2":  # the scaled residual projections are what a parent-first walk lost
        assert 0.0068 < float(eager["transformer.h.3.mlp.c_proj.weight"].std()) < 0.0074
    for meta in run_distributed(ioc.meta_prepared, world, args=(name,), init=False, timeout=300):
        assert _compare(eager, other, meta) == []


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(64, 64))


class Parent(nn.Module):
    """``init`` sets a child's weight (as GPT-2's attention sets its c_proj); child ``b``'s
    initialisation sets its parent's ``gain``, before the parent's turn."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(3))
        self.a, self.b = Child(), Child()
        object.__setattr__(self.b, "peer", self)  # a plain reference, not a submodule


class Fussy(nn.Module):
    """Its ``init`` reads a child's value (``.item()``): it cannot run on the meta device, so
    the dry run cannot tell what it writes, and its whole subtree is held until it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Child()


def _init(module: nn.Module) -> None:
    if isinstance(module, Fussy):
        nn.init.constant_(module.inner.weight, 3.0 + module.inner.weight[0, 0].item())
    elif isinstance(module, Child):
        nn.init.constant_(module.weight, 1.0)
        if hasattr(module, "peer"):
            nn.init.constant_(module.peer.gain, 3.0)
    elif isinstance(module, Parent):
        nn.init.constant_(module.a.weight, 2.0)  # overrides the child's 1.0
    elif isinstance(module, nn.Linear):
        module.reset_parameters()


def _order_case() -> dict:
    rt = rw.init(strategy="zero3")
    with torch.device("meta"):
        model = nn.Sequential(Parent(), nn.Linear(4, 4), Fussy())
    model, _ = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), init=_init)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_parent_init_wins_over_child_under_zero3():
    for state in run_distributed(_order_case, 2, init=False, timeout=120):
        assert torch.equal(state["0.a.weight"], torch.full((64, 64), 2.0))
        assert torch.equal(state["0.b.weight"], torch.full((64, 64), 1.0))
        assert torch.equal(state["0.gain"], torch.full((3,), 3.0))
        assert torch.equal(state["2.inner.weight"], torch.full((64, 64), 4.0))  # 3 + the child's 1


def test_second_pass_models_warn():
    rt = rw.init(strategy="single")
    with torch.device("meta"):
        model = ioc.build("gpt2")
    with pytest.warns(UserWarning, match=r"exact_init=True cannot reproduce .*GPT2LMHeadModel"):
        rt.prepare(model, init=model._init_weights, exact_init=True)

    class Net(nn.Module):  # nanoGPT's pattern: layers, then self.apply(self._init_weights)
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    with torch.device("meta"):
        net = Net()
    with pytest.warns(UserWarning, match=r"Net has _init_weights\(\).*init=model._init_weights"):
        rt.prepare(net)
