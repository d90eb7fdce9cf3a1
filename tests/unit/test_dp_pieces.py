"""DataParallel's pieces one by one: scatter, gather, replicate, parallel_apply (CPU replicas)."""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from rankwise.errors import ConfigError
from rankwise.parallel import gather, parallel_apply, replicate, scatter
from rankwise.parallel.dp.replicate import copy_coalesced

CPU3 = ["cpu", "cpu", "cpu"]
Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    meta: str


def test_scatter_splits_nested_tensors_and_shares_other_values():
    x = torch.arange(20.0).view(10, 2)
    y = torch.arange(10)
    note = threading.Lock()  # any non-container object
    scale = torch.tensor(3.0)
    inputs = (Batch(x, "m"), [Pair(y, note)], OrderedDict(z=x + 1))
    args, kwargs = scatter(inputs, {"scale": scale, "flag": True}, CPU3)

    assert len(args) == len(kwargs) == 3
    starts, sizes = [0, 4, 7], [4, 3, 3]
    for i, (a, kw) in enumerate(zip(args, kwargs, strict=True)):
        rows = slice(starts[i], starts[i] + sizes[i])
        assert type(a[0]) is Batch and a[0].meta == "m"
        assert torch.equal(a[0].x, x[rows])
        assert type(a[1][0]) is Pair and torch.equal(a[1][0].a, y[rows])
        assert a[1][0].b is note  # non-tensors reach every replica as the same object
        assert type(a[2]) is OrderedDict and torch.equal(a[2]["z"], x[rows] + 1)
        assert kw["scale"] is scale and kw["flag"] is True  # 0-dim: copied, not split


def test_scatter_balances_chunks_and_uses_fewer_devices_for_a_small_batch():
    four = ["cpu"] * 4
    args, _ = scatter((torch.zeros(10, 1),), None, four)
    assert [a[0].shape[0] for a in args] == [3, 3, 2, 2]
    args, _ = scatter((torch.zeros(2, 1),), None, four)
    assert [a[0].shape[0] for a in args] == [1, 1]
    args, _ = scatter(("no tensors",), {"k": 1}, four)
    assert args == [("no tensors",)]


def test_scatter_along_another_dim_keeps_autograd_to_the_input():
    x = torch.randn(3, 5, requires_grad=True)
    args, _ = scatter((x,), None, ["cpu", "cpu"], dim=1)
    assert [a[0].shape for a in args] == [(3, 3), (3, 2)]
    (args[0][0].sum() + 2 * args[1][0].sum()).backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 1, 1, 2, 2]] * 3))


def test_scatter_rejects_an_empty_batch_naming_the_argument():
    with pytest.raises(ConfigError) as err:
        scatter((torch.zeros(0, 4),), None, CPU3)
    assert str(err.value) == (
        "scatter: `args[0]` is an empty batch (shape (0, 4), size 0 along dim 0); there is "
        "nothing to split over the devices\nFix: skip empty batches before calling the model "
        "(or DataLoader(drop_last=True) when the data set size is the cause)"
    )


def test_scatter_rejects_mismatched_batch_sizes_naming_both_arguments():
    with pytest.raises(ConfigError) as err:
        scatter(({"x": torch.zeros(8, 2)},), {"mask": torch.zeros(7)}, CPU3)
    assert str(err.value).startswith(
        "scatter: `kwargs['mask']` has size 7 along dim 0, but `args[0]['x']` has 8; every "
        "tensor argument is split into per-device chunks of the batch, so all must have the "
        "same batch size\nFix: "
    )


def test_gather_concatenates_with_the_same_nesting_and_stacks_scalars():
    outs = [
        {"y": torch.full((2, 3), float(i)), "loss": torch.tensor(float(i)), "none": None, "k": i}
        for i in range(3)
    ]
    got = gather(outs, "cpu")
    assert torch.equal(got["y"], torch.cat([torch.full((2, 3), float(i)) for i in range(3)]))
    assert torch.equal(got["loss"], torch.tensor([0.0, 1.0, 2.0]))
    assert got["none"] is None and got["k"] == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"`output` has a different structure"):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], "cpu")


def _tied_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False), nn.BatchNorm1d(5))
    net[1].weight = net[0].weight  # tied: one parameter used twice
    return net


def test_replicas_alias_master_parameters_and_backward_accumulates_on_the_master():
    net = _tied_net()
    replicas = replicate(net, ["cpu", "cpu"])
    assert list(replicas[0].parameters()) == []  # replicas hold non-leaf tensors, not Parameters
    for r in replicas:
        assert r[0].weight is r[1].weight  # ties survive replication
        assert r[0].weight.data_ptr() == net[0].weight.data_ptr()  # a view, not a copy
    assert replicas[0][2].running_mean is net[2].running_mean  # replica 0's BN stats persist
    assert replicas[1][2].running_mean.data_ptr() != net[2].running_mean.data_ptr()

    idx = torch.tensor([0, 3, 3, 1])
    (replicas[0](idx).sum() + replicas[1](idx[:2]).sum()).backward()
    expected = nn.Sequential(*_tied_net())
    (expected(idx).sum() + expected(idx[:2]).sum()).backward()
    for p, q in zip(net.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


def test_copy_coalesced_copies_values_and_routes_gradients_back():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    n = torch.arange(3)  # another dtype: its own flat buffer
    ca, cb, cn = copy_coalesced([a, b, n], torch.device("cpu"))
    assert torch.equal(ca, a) and torch.equal(cb, b) and torch.equal(cn, n)
    assert ca.data_ptr() != a.data_ptr()  # a real copy
    (ca.sum() * 2 + (cb * cb).sum()).backward()
    assert torch.equal(a.grad, torch.full((2, 3), 2.0)) and torch.equal(b.grad, 2 * b.detach())


def _boom_if_negative(x: torch.Tensor) -> torch.Tensor:
    if (x < 0).any():
        raise ValueError(f"negative input of shape {tuple(x.shape)}")
    return x * 2


def test_parallel_apply_runs_threads_and_keeps_the_callers_grad_mode():
    names: list[str] = []

    def fn(x):
        names.append(threading.current_thread().name)
        return x * 2

    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        outs = parallel_apply([fn, fn], [(x,), (x + 1,)], None, ["cpu", "cpu"])
    assert [o.tolist() for o in outs] == [[2.0, 2.0], [4.0, 4.0]]
    assert not outs[0].requires_grad  # no_grad followed the work into the replica threads
    # Replica 0 runs in the caller's thread, the others in threads of their own.
    assert (
        names[0] == threading.current_thread().name or names[1] == threading.current_thread().name
    )
    assert "rankwise-replica-1" in names


def test_parallel_apply_reraises_the_replicas_exception_with_device_and_traceback():
    inputs = [(torch.ones(2),), (-torch.ones(3),), (torch.ones(1),)]
    with pytest.raises(ValueError) as err:
        parallel_apply([_boom_if_negative] * 3, inputs, None, CPU3)
    assert str(err.value) == "negative input of shape (3,)"  # the original exception object
    assert err.value.__notes__ == ["rankwise.parallel.parallel_apply: raised in replica 1 on device cpu"]
    text = "".join(traceback.format_exception(err.value))
    # The original frames from inside the replica thread are kept, down to the raising line.
    assert "in _boom_if_negative" in text
    assert 'raise ValueError(f"negative input of shape {tuple(x.shape)}")' in text


def test_replicate_copies_the_module_under_torch_compile_not_the_masters_submodules():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    replicas = replicate(torch.compile(net, backend="eager"), ["cpu", "cpu"])
    x = torch.randn(3, 4)
    for r in replicas:
        # Each replica computes with its own submodules and (autograd-linked) tensors.
        assert r[0] is not net[0] and r[0].weight is not net[0].weight
        torch.testing.assert_close(r(x), net(x))
    (replicas[0](x).sum() + replicas[1](x).sum()).backward()
    want = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    want.load_state_dict(net.state_dict())
    (2 * want(x).sum()).backward()
    torch.testing.assert_close(net[0].weight.grad, want[0].weight.grad)
    # The replica's tensors are the ones its forward reads (the old copy ran the master's).
    replicas[1][2].bias = torch.full((2,), 7.0)
    moved = replicas[1](x) - replicas[0](x)
    torch.testing.assert_close(moved, (7.0 - net[2].bias).expand(3, 2).detach())
