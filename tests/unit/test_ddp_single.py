"""DistributedDataParallel in one process (world size 1: not launched, no process group).

World size 1 is the normal case: the wrapper communicates nothing, trains exactly like the
bare module, and still reports the mistakes it would report on many ranks.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _train(model: nn.Module, steps: int = 5) -> None:
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _fresh(seed: int = 0) -> TwoHeads:
    torch.manual_seed(seed)
    return TwoHeads()


def test_unlaunched_wrapper_trains_exactly_like_the_bare_module():
    bare = _fresh()
    _train(bare)
    wrapped = rw.DistributedDataParallel(_fresh(), find_unused_parameters=True)
    _train(wrapped)
    for (name, a), b in zip(
        bare.state_dict().items(), wrapped.module.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert wrapped.module.spare.weight.grad is None  # unused everywhere: left untouched


def test_unused_parameter_is_reported_at_world_size_one_too():
    model = rw.DistributedDataParallel(_fresh())
    with pytest.raises(rw.ConfigError) as info:
        model(torch.randn(4, 6)).sum().backward()
    assert str(info.value) == (
        "[rank 0] 2 of 8 parameters got no gradient in this backward pass: spare.weight, "
        "spare.bias. DistributedDataParallel cannot average a gradient that was never computed, "
        "and with find_unused_parameters=False it does not look for such parameters\n"
        "Fix: set find_unused_parameters=True in DistributedDataParallel(...) if these parameters "
        "are unused on purpose (a branch that is skipped, an auxiliary head), or freeze them with "
        "requires_grad_(False) before wrapping if they never train."
    )
    model.module.spare.requires_grad_(False)  # frozen parameters are skipped
    model = rw.DistributedDataParallel(model.module)
    model(torch.randn(4, 6)).sum().backward()
    assert model.module.spare.weight.grad is None


def test_state_dict_has_no_module_prefix_and_load_accepts_both():
    model = rw.DistributedDataParallel(_fresh(), find_unused_parameters=True)
    _train(model, 2)
    state = model.state_dict()
    assert list(state) == list(model.module.state_dict())
    bare = _fresh(1)
    assert not bare.load_state_dict(state).missing_keys  # docs/pitfalls.md#pitfall-5 is gone
    other = rw.DistributedDataParallel(_fresh(2))
    other.load_state_dict(state)
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())
    third = rw.DistributedDataParallel(_fresh(3))
    prefixed = {f"module.{k}": v for k, v in state.items()}  # e.g. saved from torch's DDP
    third.load_state_dict(prefixed)
    assert all(torch.equal(state[k], v) for k, v in third.state_dict().items())
    with pytest.raises(RuntimeError, match="Missing key"):
        third.load_state_dict({k: v for k, v in state.items() if k != "head.bias"})


def test_deepcopy_and_torch_save_give_working_wrappers():
    model = rw.DistributedDataParallel(_fresh(), find_unused_parameters=True)
    _train(model, 2)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert isinstance(clone, rw.DistributedDataParallel)
        assert all(
            torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters(), strict=True)
        )
        twin = copy.deepcopy(model.module)
        _train(clone, 2)
        _train(twin, 2)
        assert all(
            torch.equal(a, b)
            for a, b in zip(twin.parameters(), clone.module.parameters(), strict=True)
        )


def test_launched_without_process_group_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(rw.RuntimeStateError) as info:
        rw.DistributedDataParallel(_fresh())
    assert str(info.value) == (
        "[rank 1] DistributedDataParallel needs a process group: this process is rank 1 of "
        "WORLD_SIZE=2 (from launcher), but torch.distributed is not initialised\n"
        "Fix: call `rt = rw.init()` at the start of the program, before wrapping the model."
    )


def test_cpu_module_with_cuda_device_ids_says_move_it_first():
    with pytest.raises(rw.ConfigError) as info:
        rw.DistributedDataParallel(_fresh(), device_ids=[0], output_device=0)
    assert str(info.value) == (
        "[rank 0] the module's parameters are on cpu but device_ids=[0] asks for cuda:0\n"
        "Fix: move the model to cuda:K (or rt.device) before wrapping: model = "
        "Net().to(rt.device); DistributedDataParallel(model, device_ids=[rt.local_rank])."
    )


def test_several_device_ids_and_bad_compression_are_refused():
    with pytest.raises(rw.ConfigError, match=r"device_ids=\[0, 1\] names 2 devices"):
        rw.DistributedDataParallel(_fresh(), device_ids=[0, 1])
    with pytest.raises(rw.ConfigError, match="compression='int4' is not supported"):
        rw.DistributedDataParallel(_fresh(), compression="int4")
    with pytest.raises(rw.ConfigError, match="has no parameter with requires_grad=True"):
        rw.DistributedDataParallel(_fresh().requires_grad_(False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_module_with_device_ids_moves_inputs():
    model = rw.DistributedDataParallel(_fresh().cuda(), device_ids=[0], find_unused_parameters=True)
    out = model(torch.randn(4, 6))  # a CPU batch is moved to cuda:0, like torch's DDP
    assert out.device == torch.device("cuda", 0)
    out.sum().backward()
    assert model.module.head.weight.grad.device == torch.device("cuda", 0)
