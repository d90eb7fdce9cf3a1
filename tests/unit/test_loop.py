"""The loop verbs in one process: precision policies, the loss scaler's guard, clipping,
accumulation boundaries, schedulers in checkpoints, rt.log files."""

from __future__ import annotations

import csv
import json
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.output.metrics import MetricsLogger

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _xy(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _inner_dtypes(model: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    return seen


def test_unknown_precision_is_refused_with_the_choices():
    with pytest.raises(rw.ConfigError, match=r"precision='fp8'.*'bf16-mixed'") as info:
        rw.init(precision="fp8")
    assert "Fix:" in str(info.value)


def test_a_second_init_cannot_change_the_precision():
    rw.init(precision="bf16-mixed")
    assert rw.init().precision == "bf16-mixed"
    with pytest.raises(rw.RuntimeStateError, match=r"precision='bf16-mixed'.*precision='32'"):
        rw.init(precision="32")


def test_bf16_mixed_runs_the_forward_under_autocast_with_fp32_weights_and_outputs():
    rt = rw.init(precision="bf16-mixed")
    model = _net()
    seen = _inner_dtypes(model)
    model = rt.prepare(model)
    out = model(_xy()[0])
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.is_autocast_enabled("cpu")  # the region ended with the forward


def test_autocast_region_ends_when_the_forward_raises():
    rt = rw.init(precision="bf16-mixed")
    model = rt.prepare(_net())
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width
    assert not torch.is_autocast_enabled("cpu")


_REPLICA_STATE: list[tuple[int, bool, torch.dtype]] = []


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _REPLICA_STATE.append(
            (threading.get_ident(), torch.is_autocast_enabled("cpu"), self.lin(x).dtype)
        )
        return self.lin(x)


def test_dataparallel_threads_each_run_under_autocast():
    _REPLICA_STATE.clear()
    rt = rw.init(strategy="dp", devices=["cpu", "cpu"], precision="bf16-mixed")
    model = rt.prepare(_Probe())
    model(_xy()[0])
    assert len({ident for ident, _, _ in _REPLICA_STATE}) == 2  # two threads
    assert all(on and dtype == torch.bfloat16 for _, on, dtype in _REPLICA_STATE)


def test_bf16_true_stores_bf16_weights_and_casts_inputs():
    rt = rw.init(precision="bf16-true")
    model = rt.prepare(_net())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model(_xy()[0]).dtype == torch.bfloat16


def test_fp16_refuses_gradients_from_a_plain_backward():
    rt = rw.init(precision="fp16-mixed")
    net = _net()
    model, opt = rt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _xy()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(rw.ConfigError, match=r"(?s)loss\.backward\(\).*Fix: call rt\.backward"):
        opt.step()
    opt.zero_grad()
    rt.backward(F.cross_entropy(model(x), y))
    opt.step()  # through the scaler: accepted
    assert opt.scaler.get_scale() > 1.0


def test_fp16_clipping_unscales_first():
    x, y = _xy()
    reference = _net()
    F.cross_entropy(reference(x), y).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    rt = rw.init(precision="fp16-mixed")
    net = _net()
    model, opt = rt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.backward(F.cross_entropy(model(x), y))
    norm = rt.clip_grad_norm_(model, 1e9)
    assert abs(norm.item() - want.item()) < 1e-2 * want.item()  # not 65536 times larger
    opt.step()  # unscale_ is not repeated by step


def test_clip_grad_value_and_the_engine_contract():
    rt = rw.init()
    model = rt.prepare(_net())
    x, y = _xy()
    rt.backward(100 * F.cross_entropy(model(x), y))
    rt.clip_grad_value_(model, 0.01)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01

    class Sharded(nn.Linear):
        def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
            return torch.tensor(max_norm * 10 + norm_type)

    assert rt.clip_grad_norm_(Sharded(2, 2), 1.0, 3.0).item() == 13.0


def test_accumulate_syncs_every_steps_and_on_the_last_batch_of_the_epoch():
    rt = rw.init()
    net = _net()
    x, y = _xy(40)
    model, _, loader = rt.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(TensorDataset(x, y), batch_size=4)
    )
    for _epoch in range(2):  # the short last group of epoch 0 must not leak into epoch 1
        pattern = []
        for xb, yb in loader:
            with rt.accumulate(model, steps=4) as acc:
                rt.backward(F.cross_entropy(model(xb), yb))
                pattern.append((acc.index, acc.sync))
        assert pattern == [(0, False), (1, False), (2, False), (3, True)] * 2 + [
            (0, False),
            (1, True),
        ]
    with pytest.raises(rw.ConfigError, match=r"steps=0"), rt.accumulate(model, steps=0):
        pass


def test_scheduler_is_returned_and_saved_with_the_scaler(tmp_path):
    rt = rw.init(precision="fp16-mixed")
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt2, sched2 = rt.prepare(net, opt, scheduler=sched)
    assert sched2 is sched
    x, y = _xy()
    for _ in range(3):
        rt.backward(F.cross_entropy(model(x), y))
        opt2.step()
        opt2.zero_grad()
        sched.step()
    opt2.scaler.update(1234.0)
    rt.save(tmp_path / "ckpt.pt", model=model, optimizer=opt2)
    rw.shutdown()
    rt = rw.init(precision="fp16-mixed")
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    fresh = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, _ = rt.prepare(net, opt, scheduler=fresh)
    rt.load(tmp_path / "ckpt.pt", model=model, optimizer=opt)
    assert fresh.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)
    assert opt.scaler.get_scale() == 1234.0


def test_metrics_logger_writes_csv_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as log:
        log.log({"loss": torch.tensor(0.5), "acc": 0.25}, step=1)
        log.log({"loss": 0.25})  # step 2: one more than the last
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["step"], r["name"], float(r["value"])) for r in rows] == [
        ("1", "loss", 0.5),
        ("1", "acc", 0.25),
        ("2", "loss", 0.25),
    ]
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(d["step"], d["loss"]) for d in lines] == [(1, 0.5), (2, 0.25)]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]


def test_rt_log_refuses_what_is_not_a_number(tmp_path):
    rt = rw.init()
    rt.log_to(tmp_path, tensorboard=False)
    with pytest.raises(rw.ConfigError, match=r"'loss' as a tensor of shape \(3,\)"):
        rt.log({"loss": torch.ones(3)})
    with pytest.raises(rw.ConfigError, match=r"reduce='avg'"):
        rt.log({"loss": 1.0}, reduce="avg")


def test_launch_refuses_a_function_it_cannot_send():
    with pytest.raises(rw.ConfigError, match="module level"):
        rw.launch(lambda: None, nprocs=2)
    with pytest.raises(rw.ConfigError, match="nprocs=0"):
        rw.launch(_net, nprocs=0)


@pytest.mark.gpu
@needs_cuda
def test_fp16_mixed_with_scaler_on_cuda():
    rt = rw.init(precision="fp16-mixed", device="cuda")
    net = _net()
    model, opt = rt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = _inner_dtypes(rw.unwrap_model(model))
    x, y = (t.cuda() for t in _xy())
    first = None
    for _ in range(5):
        loss = F.cross_entropy(model(x), y)
        first = first if first is not None else loss.item()
        rt.backward(loss)
        rt.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    assert seen[0] == torch.float16 and model(x).dtype == torch.float32
    assert opt.scaler.get_scale() > 1.0 and loss.item() < first


@pytest.mark.gpu
@needs_cuda
def test_bf16_mixed_on_cuda_matches_torch_autocast():
    x = _xy()[0].cuda()
    ref = _net().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = ref(x).float()
    rt = rw.init(precision="bf16-mixed", device="cuda")
    got = rt.prepare(_net())(x)
    assert torch.equal(got, want)


def test_pipeline_no_sync_skips_the_data_parallel_average():
    rt = rw.init()
    stage = rw.DistributedPipeline(_net(), ranks=[0])
    averaged = []
    stage._average_gradients = lambda: averaged.append(True)
    x, y = _xy(20)
    for i in range(5):
        with rt.accumulate(stage, steps=3) as acc:
            stage.train_step(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4], F.cross_entropy)
            averaged.append(acc.sync)
    # After each train_step: True (averaged) only on the group's last micro-batch.
    assert averaged == [False, False, True, True, False, False]


def _group_grads(**kwargs) -> list[torch.Tensor]:
    """Gradients after one group of 2 micro-batches of 4 through rt.accumulate + rt.backward."""
    rt = rw.init()
    model = rt.prepare(_net())
    x, y = _xy(8)
    for i in range(2):
        with rt.accumulate(model, steps=2, **kwargs):
            rt.backward(F.cross_entropy(model(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]))
    return [p.grad.clone() for p in model.parameters()]


def test_accumulate_gives_the_mean_over_the_group_by_default_and_the_sum_by_name():
    net = _net()
    x, y = _xy(8)
    F.cross_entropy(net(x), y).backward()  # one batch of 8: the mean's gradient
    mean = [p.grad.clone() for p in net.parameters()]
    for got, want in zip(_group_grads(), mean, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for kwargs in ({"reduction": "sum"}, {"scale_loss": False}):
        for got, want in zip(_group_grads(**kwargs), mean, strict=True):
            torch.testing.assert_close(got, 2 * want, rtol=1e-5, atol=1e-6)
    rt = rw.init()
    error = r"(?s)reduction=.avg.*Fix: pass reduction=.mean."
    with pytest.raises(rw.ConfigError, match=error), rt.accumulate(net, steps=2, reduction="avg"):
        pass
