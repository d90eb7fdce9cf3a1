"""torch-compatibility of DistributedDataParallel in one process: exception types, arguments,
and inputs moved to the device keeping their container types (one shared tree walker)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.errors import ModelError
from rankwise.parallel.agreement import move_to_device
from rankwise.parallel.dp.scatter_gather import non_blocking, to_device

Pair = namedtuple("Pair", ["x", "mask"])


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    meta: str


def test_errors_are_also_the_builtin_type_torch_raises():
    # No trainable parameter: torch raises RuntimeError.
    with pytest.raises(RuntimeError, match="has no parameter with requires_grad=True") as info:
        rw.DistributedDataParallel(nn.Module())
    assert isinstance(info.value, rw.ConfigError) and isinstance(info.value, ModelError)
    # A parameter without gradient (find_unused_parameters=False): RuntimeError as in torch.
    model = rw.DistributedDataParallel(nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}))
    with pytest.raises(RuntimeError, match=r"b\.weight"):
        model.module["a"](torch.randn(1, 2)).sum().backward()
    # Several device ids: ValueError as in torch.
    with pytest.raises(ValueError, match="names 2 devices"):
        rw.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0, 1])
    # Launched (WORLD_SIZE=2) without a process group: torch raises ValueError.
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
            mp.setenv(key, value)
        with pytest.raises(ValueError, match="needs a process group") as caught:
            rw.DistributedDataParallel(nn.Linear(2, 2))
        assert isinstance(caught.value, rw.RuntimeStateError)
    # A communication hook that is not callable: TypeError as in torch.
    with pytest.raises(TypeError, match=r"Communication hook must be callable\. Got 3"):
        rw.DistributedDataParallel(nn.Linear(2, 2)).register_comm_hook(None, 3)


def test_torch_arguments_refused_name_the_alternative():
    with pytest.raises(ValueError, match="need to be set at the same time"):
        rw.DistributedDataParallel(nn.Linear(2, 2), delay_all_reduce_named_params=[])
    with pytest.raises(rw.ConfigError, match=r"torch\.autocast"):
        rw.DistributedDataParallel(nn.Linear(2, 2), mixed_precision=object())
    with pytest.raises(rw.ConfigError, match="bucket_cap_mb_list"):
        rw.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb_list=[1, 2])
    with pytest.raises(rw.ConfigError, match="divide_by_initial_world_size=False"):
        rw.DistributedDataParallel(nn.Linear(2, 2)).join(divide_by_initial_world_size=False)
    with pytest.warns(FutureWarning, match="check_reduction"):
        rw.DistributedDataParallel(nn.Linear(2, 2), check_reduction=True)


def test_static_graph_switch_only_before_training():
    model = rw.DistributedDataParallel(nn.Linear(2, 2))
    model._set_static_graph()
    assert model.static_graph
    model(torch.randn(3, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="should be called before training loop starts"):
        model._set_static_graph()


def test_moving_inputs_keeps_container_types():
    x = torch.randn(2, 3)
    nested = (
        Pair(x, [x, {"k": x}]),
        OrderedDict(a=Batch(x, "meta"), b=3),
        [x],
    )
    moved = move_to_device(nested, torch.device("cpu"))
    assert type(moved[0]) is Pair and type(moved[1]) is OrderedDict
    assert type(moved[1]["a"]) is Batch and moved[1]["a"].meta == "meta"
    assert moved[1]["b"] == 3 and isinstance(moved[0].mask[1], dict)
    assert torch.equal(moved[0].x, x)
    assert to_device(Pair(x, None), "cpu").mask is None


def test_one_non_blocking_rule_only_towards_an_accelerator():
    assert non_blocking(torch.device("cpu")) is False
    assert non_blocking(torch.device("cuda", 0)) is True


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, batch: Pair) -> torch.Tensor:
        assert isinstance(batch, Pair)  # not flattened into a tuple on the way in
        return self.lin(batch.x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_namedtuple_input_reaches_the_module_on_cuda():
    model = rw.DistributedDataParallel(_Named().cuda(), device_ids=[0])
    out = model(Pair(torch.randn(2, 3), None))
    assert out.device.type == "cuda"
