"""DataParallel against its oracles: single-device training on the full batch, and torch's DP."""

from __future__ import annotations

import copy
import dataclasses
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.errors import ConfigError

# 20 steps: even batches, uneven splits (13 on 2 or 3 devices), and a last batch of 2 rows,
# smaller than 3 devices (so only 2 replicas run).
BATCHES = [12] * 9 + [13, 7] * 5 + [2]


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    extra: dict


class Net(nn.Module):
    """Nested in (a dataclass holding a dict holding a tuple), nested out (a dict with a list)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 16)
        self.aux = nn.Linear(3, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, batch: Inputs, *, scale: float = 1.0) -> dict:
        h = torch.tanh(self.enc(batch.x) + self.aux(batch.extra["aux"][0])) * scale
        return {"logits": self.head(h), "hidden": [h]}


def criterion(out: dict, y: torch.Tensor) -> torch.Tensor:
    """A per-sample mean: cross-entropy plus an activation penalty."""
    return F.cross_entropy(out["logits"], y) + 0.1 * out["hidden"][0].pow(2).mean()


def _data(step: int) -> tuple[Inputs, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    n = BATCHES[step]
    x, aux = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
    return Inputs(x, {"aux": (aux,)}), torch.randint(0, 4, (n,), generator=g)


def _train(model: nn.Module, loss_of) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(len(BATCHES)):
        inputs, y = _data(step)
        loss = loss_of(model, inputs, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("mode", ["standard", "balanced"])
def test_twenty_steps_equal_single_device_training_on_the_full_batch(mode, replicas):
    torch.manual_seed(0)
    oracle = Net()
    net = copy.deepcopy(oracle)
    _train(oracle, lambda m, inputs, y: criterion(m(inputs, scale=0.5), y))

    devices = ["cpu"] * replicas
    if mode == "standard":
        dp = rw.DataParallel(net, device_ids=devices)
        _train(dp, lambda m, inputs, y: criterion(m(inputs, scale=0.5), y))
    else:
        dp = rw.DataParallel(net, device_ids=devices, loss_fn=criterion)
        _train(dp, lambda m, inputs, y: m(inputs, target=y, scale=0.5))
    assert dp.module is net
    assert _max_diff(net, oracle) <= 1e-6


def test_standard_mode_gathers_outputs_with_the_models_nesting():
    torch.manual_seed(0)
    net = Net()
    inputs, _ = _data(9)  # 13 rows on 3 replicas: 5, 4, 4
    out = rw.DataParallel(net, device_ids=["cpu"] * 3)(inputs, scale=0.5)
    expected = net(inputs, scale=0.5)
    assert out.keys() == {"logits", "hidden"} and isinstance(out["hidden"], list)
    torch.testing.assert_close(out["logits"], expected["logits"], rtol=0, atol=1e-6)
    torch.testing.assert_close(out["hidden"][0], expected["hidden"][0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_balanced_mode_sum_and_per_sample_losses_give_the_full_batch_gradients(reduction):
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    oracle = copy.deepcopy(net)
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    loss = rw.DataParallel(net, device_ids=["cpu"] * 3, loss_fn=loss_fn)(x, target=y)
    expected = loss_fn(oracle(x), y)
    assert loss.shape == expected.shape
    (loss.sum() * 0.3).backward()
    (expected.sum() * 0.3).backward()
    for p, q in zip(net.parameters(), oracle.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


def test_state_dict_has_no_module_prefix_and_loading_accepts_both():
    torch.manual_seed(0)
    dp = rw.DataParallel(Net(), device_ids=["cpu", "cpu"])
    state = dp.state_dict()
    assert list(state) == [
        "enc.weight",
        "enc.bias",
        "aux.weight",
        "aux.bias",
        "head.weight",
        "head.bias",
    ]
    Net().load_state_dict(state)  # loads into the bare model (docs/pitfalls.md#pitfall-5)

    prefixed = torch.nn.DataParallel(dp.module).state_dict()  # torch's own, with `module.`
    assert next(iter(prefixed)) == "module.enc.weight"
    for source in (state, prefixed):
        fresh = rw.DataParallel(Net(), device_ids=["cpu", "cpu"])
        fresh.load_state_dict(source)  # strict
        assert _max_diff(fresh.module, dp.module) == 0.0

    parent = nn.ModuleDict({"dp": rw.DataParallel(Net(), device_ids=["cpu", "cpu"])})
    assert next(iter(parent.state_dict())) == "dp.enc.weight"
    parent.load_state_dict(parent.state_dict())  # nested inside another module too


def test_an_empty_batch_is_a_clear_error():
    dp = rw.DataParallel(nn.Linear(4, 2), device_ids=["cpu", "cpu"])
    with pytest.raises(
        ConfigError, match=r"^scatter: `args\[0\]` is an empty batch \(shape \(0, 4\)"
    ):
        dp(torch.zeros(0, 4))


def test_mismatched_inputs_name_the_argument():
    dp = rw.DataParallel(nn.Linear(4, 2), device_ids=["cpu", "cpu"], loss_fn=F.mse_loss)
    with pytest.raises(ConfigError) as err:
        dp(torch.zeros(8, 4), target=torch.zeros(6, 2))
    assert str(err.value).startswith(
        "scatter: `kwargs['target']` has size 6 along dim 0, but `args[0]` has 8;"
    )


class _FailsOnNegativeRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            raise RuntimeError("replica saw a negative row")
        return self.lin(x)


def test_an_exception_in_one_replica_names_its_device_and_keeps_the_traceback():
    dp = rw.DataParallel(_FailsOnNegativeRows(), device_ids=["cpu"] * 3)
    x = torch.ones(9, 2)
    x[8] = -1.0  # row 8 lands on replica 2 (rows 6-8)
    with pytest.raises(RuntimeError) as err:
        dp(x)
    assert str(err.value) == "replica saw a negative row"
    assert err.value.__notes__ == ["rankwise.parallel.parallel_apply: raised in replica 2 on device cpu"]
    text = "".join(traceback.format_exception(err.value))
    assert 'raise RuntimeError("replica saw a negative row")' in text


def test_a_model_not_on_the_first_device_is_rejected_with_the_fix():
    with pytest.raises(ConfigError) as err:
        rw.DataParallel(nn.Linear(2, 2).to("meta"), device_ids=["cpu", "cpu"])
    assert str(err.value) == (
        "DataParallel: the model's tensor `weight` is on meta, but device_ids[0] is cpu; the "
        "master copy must be on the first device\nFix: call model.to('cpu') before wrapping "
        "(or list meta first in device_ids)"
    )


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator message")
def test_integer_device_ids_without_an_accelerator_suggest_cpu_replicas():
    with pytest.raises(ConfigError) as err:
        rw.DataParallel(nn.Linear(2, 2), device_ids=[0, 1])
    assert str(err.value) == (
        "device_ids[0]=0 names accelerator device 0, but no accelerator (CUDA, ...) is "
        "available in this process\nFix: use device_ids=['cpu', 'cpu'] for CPU replicas "
        "(threads on the CPU), or run on a machine with GPUs"
    )


def test_a_loss_fn_that_does_not_reduce_to_a_scalar_is_rejected():
    dp = rw.DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2, loss_fn=lambda out, y: out - y)
    with pytest.raises(
        ConfigError, match=r"loss_fn returned \(2, 2\) on replica 0 with loss_reduction='mean'"
    ):
        dp(torch.ones(4, 2), target=torch.ones(4, 2))


class TupleNet(Net):
    """Net taking (x, {"aux": (aux,)}): torch's DP scatters dicts and tuples, not dataclasses."""

    def forward(self, x: torch.Tensor, extra: dict, *, scale: float = 1.0) -> dict:
        return super().forward(Inputs(x, extra), scale=scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_outputs_and_gradients_equal_torch_data_parallel_on_cuda():
    torch.manual_seed(0)
    devices = list(range(torch.cuda.device_count()))
    ours_net = TupleNet().cuda(0)
    torch_net = copy.deepcopy(ours_net)
    batch, y = _data(9)
    inputs = (batch.x, batch.extra)
    ours = rw.DataParallel(ours_net, device_ids=devices)(*inputs, scale=0.5)
    theirs = torch.nn.DataParallel(torch_net, device_ids=devices)(*inputs, scale=0.5)
    torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=0, atol=1e-5)
    criterion(ours, y.cuda(0)).backward()
    criterion(theirs, y.cuda(0)).backward()
    for p, q in zip(ours_net.parameters(), torch_net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)
    balanced_net = copy.deepcopy(torch_net)
    balanced_net.zero_grad()
    dp = rw.DataParallel(balanced_net, device_ids=devices, loss_fn=criterion)
    dp(*inputs, target=y, scale=0.5).backward()
    for p, q in zip(balanced_net.parameters(), torch_net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)
