"""Every engine's CUDA path on ONE GPU: the streams, copies and backends users run on GPUs.

Marked ``gpu``: skipped without CUDA; ``benchmarks/gpu_check.sh`` runs them (``-m gpu``).
Each test compares with the CPU result, a bare model on the GPU, or torch's own engine.
Most train under a non-default caller stream: a wait that targets the default stream instead
of the caller's (docs/ddp.md, docs/dp.md: CUDA streams) then reads gradients too early.

- DDP at world 1 over NCCL. NCCL refuses two ranks on one GPU and our DDP sends nothing at
  world 1, so a reducer that all-reduces anyway drives the bucket copy -> NCCL all-reduce on
  NCCL's stream -> wait -> ``.grad`` path on the one GPU there is.
- DDP at world 2 on one GPU over Gloo, which accepts CUDA tensors.
- DataParallel with ``device_ids=[0, 0]`` (two replica threads on one GPU) and ``[0]``.
- A pipeline split cpu -> cuda -> cpu, with micro-batches in stage threads.
- The parameter server and checkpoints with CUDA tensors.
"""

from __future__ import annotations

import contextlib
import copy

import ddp_cases as dc
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.parallel.ddp import distributed as ddp_module
from rankwise.parallel.ddp.reduction.reducer import Reducer
from rankwise.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 6


def _no_tf32() -> None:
    # cuDNN convolutions use TF32 by default (10-bit mantissa): oracles need full fp32.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def _mlp(width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8),
    )  # fmt: skip


def _batches(n: int = STEPS, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 32, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(n)
    ]


def _train(model: nn.Module, batches, device: torch.device, lr: float = 0.1, opt=None) -> nn.Module:
    """Steps of ``opt`` (by default SGD with momentum); batches come from pinned memory with
    non_blocking copies when on CUDA."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    cuda = device.type == "cuda"
    for x, y in batches:
        if cuda:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=cuda), y.to(device, non_blocking=cuda)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _state(model: nn.Module) -> dict:
    inner = getattr(model, "module", model)
    # numpy: tensors through run_distributed's queue would be shared-memory handles.
    return {k: v.detach().cpu().numpy().copy() for k, v in inner.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(abs(a[k].astype("float64") - b[k].astype("float64")).max()) for k in a)


def _on_side_stream(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- DDP, world 1, NCCL: the reducer's stream path ---------------------------------------------


class TalkingReducer(Reducer):
    """A reducer that all-reduces at world size 1 too (ours skips it: nobody to talk to)."""

    waited = 0
    """All-reduce works waited for at the end of backward (one per bucket per step)."""

    def _allocate(self, wire: torch.dtype | None) -> None:
        self.communicates = True
        super()._allocate(wire)

    def _finalize(self) -> None:
        # Counted where the pass ends (end_of_pass.run waits for them): launched works only.
        self.waited += sum(e is not None for e in self._works)
        super()._finalize()


def world1_ddp(backend: str, device: str, compression: str | None) -> dict:
    """One rank over ``backend``: ours (talking reducer), torch's DDP and a bare model."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        _no_tf32()
    dist.init_process_group(backend, rank=0, world_size=1)
    rw.init()  # adopts the group
    ddp_module.Reducer = TalkingReducer  # this spawned process only
    bare = _mlp(512).to(dev)
    mine, theirs = copy.deepcopy(bare), copy.deepcopy(bare)
    ids = [dev] if dev.type == "cuda" else None
    ours = rw.DistributedDataParallel(
        mine, device_ids=ids, bucket_cap_mb=0.25, compression=compression
    )
    assert isinstance(ours.reducer, TalkingReducer) and len(ours.reducer.buckets) > 1
    torch_ddp = torch.nn.parallel.DistributedDataParallel(
        theirs, device_ids=ids, bucket_cap_mb=0.25
    )
    batches = _batches()
    with _on_side_stream(dev):  # every wait must target the caller's (non-default) stream
        for model in (ours, torch_ddp, bare):
            _train(model, batches, dev)
    _sync(dev)
    return {
        "backend": dist.get_backend(),
        "grad_device": str(mine[0].weight.device),
        "buckets": len(ours.reducer.buckets),
        "waited": ours.reducer.waited,
        "ours": _state(ours),
        "torch": _state(torch_ddp),
        "bare": _state(bare),
    }


def test_ddp_world1_nccl_bucket_allreduce_equals_bare_model_and_torch():
    (res,) = run_distributed(world1_ddp, 1, args=("nccl", "cuda:0", None), init=False, timeout=180)
    assert res["backend"] == "nccl" and res["grad_device"] == "cuda:0"
    assert res["buckets"] > 1 and res["waited"] == STEPS * res["buckets"]  # every bucket travelled
    assert _max_diff(res["ours"], res["bare"]) <= 1e-6
    assert _max_diff(res["torch"], res["bare"]) <= 1e-6


def test_ddp_world1_nccl_bf16_compression_rounds_but_stays_close():
    (res,) = run_distributed(
        world1_ddp, 1, args=("nccl", "cuda:0", "bf16"), init=False, timeout=180
    )
    diff = _max_diff(res["ours"], res["bare"])
    assert 0 < diff <= 1e-2, diff  # gradients rounded to bf16 on the wire, nothing else changed


# -- DDP, world 2, one GPU over Gloo -----------------------------------------------------------

GLOO_CASES = ["cnn_adam", "branchy", "frozen", "accum_no_sync_backward", "cnn_bn"]


def world2_gloo_cases(device: str) -> dict:
    rw.init("gloo", device=device)  # both ranks share the one GPU
    _no_tf32()
    rt = rw.get_runtime()
    dev = torch.device(device)
    ids = [dev] if dev.type == "cuda" else None
    wraps = {"ours": rw.DistributedDataParallel, "torch": torch.nn.parallel.DistributedDataParallel}
    out = {}
    for name in GLOO_CASES:
        case = dc.CASES[name]
        out[name] = {}
        for engine, wrap in wraps.items():
            torch.manual_seed(1000 + rt.rank)  # different per rank: the broadcast must fix it
            model = dc.build(case.build).to(dev)
            wrapped = wrap(model, device_ids=ids, find_unused_parameters=case.find_unused)
            with _on_side_stream(dev):
                dc.train_replica(case, wrapped, rt.world_size, rt.rank)
            _sync(dev)
            out[name][engine] = _state(wrapped)
    return out


def test_ddp_world2_one_gpu_over_gloo_equals_the_oracle_and_torch():
    results = run_distributed(world2_gloo_cases, 2, args=("cuda:0",), init=False, timeout=240)
    _no_tf32()
    for name in GLOO_CASES:
        ours = [r[name]["ours"] for r in results]
        same = [k for k in ours[0] if "running_" not in k]  # BN statistics are per rank
        assert all((ours[0][k] == ours[1][k]).all() for k in same), name
        assert _max_diff(ours[0], results[0][name]["torch"]) <= 1e-5, name
        if name != "cnn_bn":  # BatchNorm uses per-rank batch statistics: no 1-process twin
            oracle = {k: v.detach().cpu().numpy() for k, v in
                      dc.train_oracle(dc.CASES[name], 2, "cuda:0").state_dict().items()}  # fmt: skip
            assert _max_diff(ours[0], oracle) <= 1e-5, name


# -- DataParallel on one GPU --------------------------------------------------------------------


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))


def _dp_train(device_ids, device: torch.device, wrap=rw.DataParallel, **kw):
    _no_tf32()
    net = _bn_net().to(device)
    dp = wrap(net, device_ids=device_ids, **kw)
    with _on_side_stream(device):
        if "loss_fn" in kw:  # balanced mode: the loss runs on each replica
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            for x, y in _batches(batch=15):  # odd: the two replicas get 8 and 7 samples
                dp(x.to(device), target=y.to(device)).backward()
                opt.step()
                opt.zero_grad()
        else:
            _train(dp, _batches(batch=15), device)
    _sync(device)
    return _state(net)


def test_data_parallel_two_replicas_on_one_gpu_equals_two_cpu_replicas():
    """[0, 0]: two threads on one GPU share the master's tensors, like ['cpu', 'cpu']."""
    cpu = _dp_train(["cpu", "cpu"], torch.device("cpu"))
    gpu = _dp_train([0, 0], torch.device("cuda", 0))
    assert _max_diff(gpu, cpu) <= 1e-4  # GPU vs CPU kernels: rounding differs, nothing else
    balanced = _dp_train([0, 0], torch.device("cuda", 0), loss_fn=nn.MSELoss())
    assert _max_diff(balanced, cpu) <= 1e-4


def test_data_parallel_on_gpu_0_equals_torch_data_parallel():
    ours = _dp_train([0], torch.device("cuda", 0))
    theirs = _dp_train([0], torch.device("cuda", 0), wrap=torch.nn.DataParallel)
    assert _max_diff(ours, theirs) <= 1e-6
    cpu = _dp_train(["cpu"], torch.device("cpu"))
    assert _max_diff(ours, cpu) <= 1e-4


def test_data_parallel_with_outputs_gathered_on_the_cpu():
    _no_tf32()
    net = _bn_net().cuda()
    x = torch.randn(64, 32)
    out = rw.DataParallel(net, device_ids=[0, 0], output_device="cpu")(x)
    assert out.device == torch.device("cpu")
    ref = rw.DataParallel(copy.deepcopy(net).cpu(), device_ids=["cpu", "cpu"])(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


# -- the pipeline across cpu and cuda ---------------------------------------------------------


def test_pipeline_split_cpu_cuda_cpu_equals_the_unsplit_cpu_model():
    _no_tf32()
    ref = _mlp()
    pipe = rw.split(copy.deepcopy(ref), devices=["cpu", "cuda:0", "cpu"], chunks=4)
    assert pipe.devices[1] == torch.device("cuda", 0)
    x, y = _batches(1, batch=32)[0]
    out_ref = ref(x)
    F.mse_loss(out_ref, y).backward()
    # The input arrives on the GPU by a non_blocking copy on a side stream: the stage threads
    # must run on that stream, or stage 0 copies it to the CPU before it has landed.
    with _on_side_stream(torch.device("cuda", 0)):
        x_gpu = x.pin_memory().to("cuda:0", non_blocking=True)
        out = pipe(x_gpu)
        F.mse_loss(out, y).backward()
    assert out.device == torch.device("cpu")
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
    grads = {n: p.grad.cpu() for n, p in pipe.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-5)
    assert len({e.stage for e in pipe.last_schedule}) == 3


def test_pipeline_stage_threads_keep_the_callers_cuda_autocast():
    pipe = rw.split(_mlp(), devices=["cuda:0", "cuda:0"], chunks=2)
    x = torch.randn(8, 32, device="cuda:0")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        piped = pipe(x)
        pipe.chunks = 1
        sequential = pipe(x)
    assert piped.dtype == sequential.dtype == torch.bfloat16
    torch.testing.assert_close(piped, sequential)


# -- the parameter server and checkpoints with CUDA tensors ------------------------------------


def test_async_parameter_server_on_cuda_equals_the_plain_optimizer():
    """World 1: the server thread and the training thread hand CUDA tensors to each other."""
    dev = torch.device("cuda", 0)
    ref = _mlp().to(dev)
    ours = copy.deepcopy(ref)
    _train(ref, _batches(), dev)
    with _on_side_stream(dev):
        opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        with rw.updates.asynchronous(ours, opt, staleness=None) as wrapped:
            for x, y in _batches():
                F.mse_loss(ours(x.to(dev)), y.to(dev)).backward()
                wrapped.step()
                wrapped.zero_grad()
    torch.cuda.synchronize()
    assert _max_diff(_state(ours), _state(ref)) <= 1e-6


def test_checkpoint_of_cuda_tensors_loads_on_the_gpu_and_on_the_cpu(tmp_path):
    rt = rw.init(device="cuda:0")
    model = _mlp().to(rt.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, _batches(2), rt.device, opt=opt)  # the saved optimizer has state to restore
    path = rw.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, step=2)
    after_save = torch.randn(4, device=rt.device)  # the CUDA RNG moved on after the save

    on_gpu = _mlp().to(rt.device)
    opt_gpu = torch.optim.Adam(on_gpu.parameters(), lr=1e-3)
    info = rw.load_checkpoint(path, model=on_gpu, optimizer=opt_gpu)  # mapped to rt.device
    assert info["step"] == 2
    assert _max_diff(_state(on_gpu), _state(model)) == 0
    state = opt_gpu.state[on_gpu[0].weight]["exp_avg"]
    assert state.device == rt.device
    torch.testing.assert_close(state, opt.state[model[0].weight]["exp_avg"], rtol=0, atol=0)
    torch.testing.assert_close(torch.randn(4, device=rt.device), after_save)  # RNG restored

    on_cpu = _mlp()
    rw.load_checkpoint(path, model=on_cpu, map_location="cpu", restore_rng=False)
    assert next(on_cpu.parameters()).device == torch.device("cpu")
    assert _max_diff(_state(on_cpu), _state(model)) == 0
