"""rw.init(strategy=...) and rt.prepare: resolution, what prepare builds, and every refusal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    DataLoader,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data import DistributedSampler as TorchDistributedSampler

import rankwise as rw
from rankwise.job import plan
from rankwise.job.env import DistEnv

CUDA = torch.cuda.is_available()
LAUNCHED = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, source="launcher")


def _data(n: int = 24) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n))


def _error(exc_info) -> str:
    return str(exc_info.value)


# -- strategy resolution ------------------------------------------------------------------------


def test_auto_is_ddp_when_launched_dp_with_devices_else_single():
    assert plan.plan("auto", None, LAUNCHED, None).strategy == "ddp"
    assert plan.plan(None, None, LAUNCHED, None).strategy == "ddp"
    dp = plan.plan("auto", ["cpu", "cpu"], DistEnv(), None)
    assert dp.strategy == "dp" and dp.devices == (torch.device("cpu"), torch.device("cpu"))
    if torch.accelerator.device_count() < 2:
        assert plan.plan("auto", None, DistEnv(), None).strategy == "single"
    # An explicit single device means one device, even on a multi-GPU machine.
    assert plan.plan("auto", None, DistEnv(), "cpu").strategy == "single"


def test_init_records_strategy_and_devices():
    rt = rw.init(strategy="dp", devices=["cpu", "cpu"])
    assert (rt.strategy, rt.devices, rt.device) == ("dp", (torch.device("cpu"),) * 2, rt.devices[0])
    assert rw.init() is rt and rw.init(strategy="auto") is rt and rw.init(strategy="dp") is rt
    rw.shutdown()
    rt = rw.init(strategy="ddp")  # ddp unlaunched: world size 1, the wrapper sends nothing
    assert (rt.strategy, rt.devices) == ("ddp", (rt.device,))


def test_bad_strategy_is_refused():
    with pytest.raises(rw.ConfigError) as exc:
        rw.init(strategy="fsdp")
    assert _error(exc) == (
        "strategy='fsdp' is not one of 'auto', 'single', 'dp', 'ddp', 'zero1', 'zero2', 'zero3'\n"
        "Fix: pass strategy='zero3' (parameters, gradients and optimizer state sharded, as FSDP), "
        "or 'zero1'/'zero2' to shard less; see docs/zero.md."
    )
    with pytest.raises(rw.ConfigError, match="or name one of 'single', 'dp', 'ddp', 'zero1'"):
        rw.init(strategy="horovod")


def test_second_init_with_another_strategy_is_refused():
    rw.init(strategy="single")
    with pytest.raises(rw.RuntimeStateError) as exc:
        rw.init(strategy="dp", devices=["cpu", "cpu"])
    assert _error(exc).startswith(
        "[rank 0] rw.init() was already called with strategy=single; this call asks for "
        "strategy=dp\nFix: call rw.init() once at the start of the program"
    )
    rw.shutdown()
    rw.init(strategy="dp", devices=["cpu", "cpu"])
    with pytest.raises(rw.RuntimeStateError) as exc:
        rw.init(strategy="dp", devices=["cpu", "cpu", "cpu"])
    assert "already called with devices=['cpu', 'cpu']; this call asks for devices=" in _error(exc)


def test_dp_and_single_under_the_launcher_are_refused_before_joining():
    for name in ("dp", "single"):
        with pytest.raises(rw.ConfigError) as exc:
            rw.init(strategy=name, devices=["cpu", "cpu"] if name == "dp" else None, env=LAUNCHED)
        assert _error(exc) == (
            f"[rank 1] strategy='{name}' runs one process, but this process is rank 1 of "
            "WORLD_SIZE=2 (from launcher)\n"
            "Fix: use strategy='ddp' (or 'auto') when launched with several processes, or start "
            "the script with plain `python train.py` for one process."
        )
        assert not rw.is_initialized()


@pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine without GPUs")
def test_dp_on_cpu_needs_devices():
    with pytest.raises(rw.ConfigError) as exc:
        rw.init(strategy="dp")
    assert _error(exc) == (
        "strategy='dp' was asked for on a machine without GPUs, and devices= was not given\n"
        "Fix: pass devices=['cpu', 'cpu'] for two CPU replicas (threads in this process), or use "
        "strategy='single'."
    )


def test_devices_with_a_one_device_strategy_is_refused():
    with pytest.raises(rw.ConfigError) as exc:
        rw.init(strategy="ddp", devices=["cpu", "cpu"])
    assert "devices=['cpu', 'cpu'] lists DataParallel's devices, but strategy='ddp'" in _error(exc)


# -- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wrap",
    [
        lambda m: rw.DataParallel(m, device_ids=["cpu"]),
        lambda m: rw.DistributedDataParallel(m),
        lambda m: nn.DataParallel(m),
    ],
    ids=["rw.DataParallel", "rw.DistributedDataParallel", "torch.nn.DataParallel"],
)
def test_an_already_wrapped_model_is_refused(wrap):
    rt = rw.init(strategy="ddp")
    wrapped = wrap(nn.Linear(2, 2))
    with pytest.raises(rw.ConfigError) as exc:
        rt.prepare(wrapped)
    cls = type(wrapped)
    assert _error(exc) == (
        f"[rank 0] rt.prepare() got a model already wrapped in {cls.__module__}."
        f"{cls.__qualname__}; strategy='ddp' wraps the model itself\n"
        "Fix: pass the bare model: rt.prepare(model.module, ...) (or build the model and call "
        "rt.prepare before wrapping it yourself)."
    )


def test_prepare_wraps_per_strategy_and_returns_what_it_was_given():
    rt = rw.init(strategy="dp", devices=["cpu", "cpu"])
    net = nn.Linear(2, 2)
    model = rt.prepare(net)
    assert isinstance(model, rw.DataParallel) and model.module is net
    assert model.device_ids == [torch.device("cpu")] * 2
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, same_opt = rt.prepare(net, opt)
    assert same_opt is opt and model.module is net
    rw.shutdown()
    net = nn.Linear(2, 2)
    assert rw.init(strategy="single").prepare(net) is net
    rw.shutdown()
    assert isinstance(rw.init(strategy="ddp").prepare(nn.Linear(2, 2)), rw.DistributedDataParallel)


def test_an_optimizer_of_another_model_is_refused():
    rt = rw.init(strategy="single")
    with pytest.raises(rw.ConfigError) as exc:
        rt.prepare(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1))
    assert _error(exc) == (
        "the optimizer holds 2 tensor(s) that are not parameters of the model (shapes [(1, 3), "
        "(1,)]); they would not be kept in sync across replicas\n"
        "Fix: build the optimizer from the model you pass: torch.optim.SGD(model.parameters(), ...)."
    )


def test_a_split_model_stays_where_it_is_and_dp_refuses_it():
    pipe = rw.split(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), devices=["cpu", "cpu"])
    assert rw.init(strategy="single").prepare(pipe) is pipe  # Pipe.to(device) would raise
    rw.shutdown()
    with pytest.raises(rw.ConfigError) as exc:
        rw.init(strategy="dp", devices=["cpu", "cpu"]).prepare(pipe)
    assert _error(exc).startswith(
        "strategy='dp' cannot wrap a model split over several devices: DataParallel copies the "
        "whole model to every device\nFix: use strategy='ddp'"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_model_and_optimizer_state_move_to_the_gpu_before_wrapping():
    net = nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters())
    F.mse_loss(net(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
    opt.step()  # Adam state now exists on the CPU
    rt = rw.init(strategy="ddp")
    model, opt = rt.prepare(net, opt)
    assert isinstance(model, rw.DistributedDataParallel) and model.device_ids == [rt.device]
    assert all(p.device == rt.device for p in net.parameters())
    state = opt.state[net.weight]
    assert state["exp_avg"].device == rt.device and state["exp_avg_sq"].device == rt.device
    opt.step()  # and the optimizer still works on the moved state


# -- the loader ---------------------------------------------------------------------------------


def test_a_plain_dataloader_becomes_an_rw_loader_keeping_its_settings():
    rt = rw.init(strategy="dp", devices=["cpu", "cpu"])

    def collate(samples):
        return {
            "x": torch.stack([s[0] for s in samples]),
            "y": torch.stack([s[1] for s in samples]),
        }

    dl = DataLoader(_data(22), batch_size=4, shuffle=False, drop_last=True, collate_fn=collate)
    loader = rt.prepare_loader(dl)
    assert isinstance(loader.loader, rw.Loader)
    assert loader.loader.dataloader.collate_fn is collate
    assert (loader.batch_size, loader.per_device_batch_size, loader.global_batch_size) == (4, 2, 4)
    batches = list(loader)
    assert len(loader) == len(batches) == 5  # drop_last kept: 22 // 4
    assert [b["y"].tolist() for b in batches[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # no shuffle


def test_shuffle_comes_from_the_sampler_and_resume_is_exact():
    rt = rw.init(strategy="single")
    loader = rt.prepare_loader(DataLoader(_data(), batch_size=4, shuffle=True))
    assert loader.sampler.shuffle is True
    loader.set_epoch(3)
    full = [y.tolist() for _, y in loader]
    assert sorted(y for batch in full for y in batch) == list(range(24)) and full[0] != [0, 1, 2, 3]
    again = rt.prepare_loader(DataLoader(_data(), batch_size=4, shuffle=True))
    again.set_epoch(3)
    it = iter(again)
    seen = [next(it)[1].tolist() for _ in range(2)]
    state = again.state_dict()
    resumed = rt.prepare_loader(DataLoader(_data(), batch_size=4, shuffle=True))
    resumed.load_state_dict(state)
    assert seen + [y.tolist() for _, y in resumed] == full


def test_an_rw_loader_is_kept():
    rt = rw.init(strategy="single")
    mine = rw.loader(_data(), batch_size=6)
    assert rt.prepare_loader(mine).loader is mine


def test_global_batch_size_gives_the_same_global_batch_under_every_strategy():
    sizes = {}
    for name, devices in (("single", None), ("dp", ["cpu", "cpu"]), ("ddp", None)):
        rt = rw.init(strategy=name, devices=devices)
        loader = rt.prepare_loader(DataLoader(_data(), batch_size=5), global_batch_size=8)
        sizes[name] = (loader.global_batch_size, loader.batch_size)
        rw.shutdown()
    assert sizes == {"single": (8, 8), "dp": (8, 8), "ddp": (8, 8)}


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda d: DataLoader(d, batch_size=4, sampler=WeightedRandomSampler([1.0] * 24, 24)),
            "rt.prepare() cannot re-create DataLoader(sampler=WeightedRandomSampler(...)): only "
            "shuffle=True or shuffle=False (RandomSampler / SequentialSampler) can be split over "
            "the ranks without changing what the sampler means\nFix: build the loader yourself: "
            "rw.loader(dataset, batch_size=B, sampler=...) with a sampler that splits the data "
            "over the ranks, and pass that to rt.prepare.",
        ),
        (
            lambda d: DataLoader(d, batch_size=4, sampler=TorchDistributedSampler(d, 1, 0)),
            "rt.prepare() cannot re-create DataLoader(sampler=DistributedSampler(...)): only "
            "shuffle=True or shuffle=False (RandomSampler / SequentialSampler) can be split over "
            "the ranks without changing what the sampler means\nFix: rt.prepare builds the "
            "distributed sampler itself: pass DataLoader(dataset, batch_size=B, shuffle=True) "
            "without sampler=.",
        ),
        (
            lambda d: DataLoader(d, batch_sampler=[[0, 1], [2, 3]]),
            "rt.prepare() cannot re-create a DataLoader built with batch_sampler=: the batches "
            "are not described by a batch size it could split over the replicas\nFix: build the "
            "loader yourself with rw.loader(dataset, batch_size=..., sampler=...) and pass it to "
            "rt.prepare (an rw.loader is kept as it is).",
        ),
    ],
    ids=["weighted", "torch-distributed", "batch_sampler"],
)
def test_unsupported_samplers_are_refused(make, expected):
    rt = rw.init(strategy="single")
    with pytest.raises(rw.ConfigError) as exc:
        rt.prepare(nn.Linear(1, 1), None, make(_data()))
    assert _error(exc) == expected


def test_dp_batch_that_does_not_split_evenly_is_refused():
    rt = rw.init(strategy="dp", devices=["cpu", "cpu", "cpu"])
    with pytest.raises(rw.ConfigError) as exc:
        rt.prepare_loader(DataLoader(_data(), batch_size=10))
    assert _error(exc) == (
        "DataLoader(batch_size=10) is the global batch under strategy='dp' and does not split "
        "evenly over 3 devices\nFix: use batch_size=9 or 12, or rt.prepare(..., "
        "global_batch_size=...)."
    )


def test_the_batch_meaning_is_logged_once(capsys):
    rt = rw.init(strategy="single")
    rt.prepare(nn.Linear(1, 1), None, DataLoader(_data(), batch_size=6))
    assert capsys.readouterr().err == (
        "[rank 0/1] rankwise prepare [single]: batch_size=6 is the batch per step: global batch 6\n"
    )
    rt.prepare_loader(DataLoader(_data(), batch_size=4), evaluation=True)
    assert capsys.readouterr().err.endswith("global batch 4 (evaluation: each sample once)\n")


def test_rank_aware_print_save_and_load(tmp_path, capsys):
    rt = rw.init(strategy="dp", devices=["cpu", "cpu"])
    model = rt.prepare(nn.Linear(2, 2))
    rt.print("hello")
    assert capsys.readouterr().out == "hello\n"
    path = rt.save(tmp_path, model=model, epoch=3)
    saved = torch.load(path, weights_only=True)["model"]
    assert sorted(saved) == ["bias", "weight"]  # no `module.` prefix
    fresh = nn.Linear(2, 2)
    assert rt.load(tmp_path, model=fresh)["epoch"] == 3
    assert torch.equal(fresh.weight, model.module.weight)
