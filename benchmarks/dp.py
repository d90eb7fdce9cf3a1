"""DataParallel vs DistributedDataParallel vs one process, and the master device's extra memory.

    flock /tmp/rankwise-bench.lock python benchmarks/dp.py --out dp.json

Same model, same global batch for every strategy (DP splits it over its replicas, DDP gives each
process ``global_batch / replicas``). Throughput (samples/s) is measured with repeats
interleaved across strategies, so a noisy neighbour slows all of them alike; medians reported.

CPU: DP replicas are threads on the CPU (``device_ids=["cpu"] * R``), DDP is R gloo processes,
one intra-op thread everywhere. CUDA (when available): DP over every GPU, torch's
``nn.DataParallel`` on the same GPUs in the same run, DDP one NCCL process per GPU.

DDP is ``rankwise.DistributedDataParallel``; torch's DDP runs beside it in the same run.

Memory, standard vs balanced (``loss_fn=``) DataParallel:
- CUDA: ``torch.cuda.max_memory_allocated`` per device over one forward+loss+backward, above
  the memory allocated before the step; the master's extra is its peak minus the largest peak
  of the other devices.
- CPU: every replica shares one device, so bytes are attributed by thread instead. A
  TorchDispatchMode is thread-local: entered in the caller thread it sees the ops that thread
  runs (replica 0, scatter, gather, the loss: the master device's work) but not the other
  replicas' (their own threads). It tracks the storage each op allocates until that storage is
  freed (storage objects are preserved, so a weakref dies exactly when the memory is released)
  and reports the peak live bytes over forward + loss. Another device's peak is the same
  measurement of one replica's work on its chunk; the master's extra is the difference, as on
  CUDA. (On a GPU the master also holds the gathered output's gradient in backward, standard
  mode only, so the CPU figure understates the standard mode's extra.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import rankwise as rw
from rankwise.parallel.dp.scatter_gather import chunk_sizes
from rankwise.testing import run_distributed


def make_model(cfg: dict) -> nn.Module:
    torch.manual_seed(0)
    d, h, c = cfg["in_features"], cfg["hidden"], cfg["classes"]
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))


def make_batch(
    cfg: dict, n: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg["in_features"], generator=g)
    y = torch.randint(0, cfg["classes"], (n,), generator=g)
    return x.to(device), y.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, steps: int, warmup: int, device: torch.device) -> float:
    """Seconds for ``steps`` calls of ``step()`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return time.perf_counter() - t0


def train_step(model: nn.Module, opt: torch.optim.Optimizer, loss_of) -> Any:
    def step() -> None:
        loss = loss_of(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def in_process(cfg: dict, strategy: str) -> float:
    """Samples/s of ``single``, ``dp``, ``dp_balanced`` or ``torch_dp`` in this process."""
    devices = cfg["devices"]
    master = torch.device(devices[0])
    model = make_model(cfg).to(master)
    x, y = make_batch(cfg, cfg["global_batch"], master)
    if strategy == "single":
        wrapped, loss_of = model, lambda m: F.cross_entropy(m(x), y)
    elif strategy == "dp":
        wrapped = rw.DataParallel(model, device_ids=devices)
        loss_of = lambda m: F.cross_entropy(m(x), y)  # noqa: E731
    elif strategy == "dp_balanced":
        wrapped = rw.DataParallel(model, device_ids=devices, loss_fn=F.cross_entropy)
        loss_of = lambda m: m(x, target=y)  # noqa: E731
    else:
        wrapped = torch.nn.DataParallel(model, device_ids=devices)
        loss_of = lambda m: F.cross_entropy(m(x), y)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = time_steps(train_step(wrapped, opt, loss_of), cfg["steps"], cfg["warmup"], master)
    return cfg["steps"] * cfg["global_batch"] / seconds


def ddp_worker(cfg: dict, impl: str) -> float:
    """One DDP rank: its share of the global batch; returns its timed seconds."""
    torch.set_num_threads(1)
    rt = rw.get_runtime()
    if impl == "rankwise":
        from rankwise import DistributedDataParallel as DDP
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
    model = make_model(cfg).to(rt.device)
    ddp = DDP(model, device_ids=[rt.device] if rt.device.type == "cuda" else None)
    x, y = make_batch(cfg, cfg["global_batch"] // rt.world_size, rt.device, seed=rt.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = train_step(ddp, opt, lambda m: F.cross_entropy(m(x), y))
    for _ in range(cfg["warmup"]):
        step()
    rw.barrier()
    return time_steps(step, cfg["steps"], 0, rt.device)


def ddp(cfg: dict, impl: str) -> float:
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    seconds = run_distributed(
        ddp_worker, cfg["replicas"], args=(cfg, impl), backend=backend, timeout=180
    )
    per_rank_batch = cfg["global_batch"] // cfg["replicas"]
    return cfg["steps"] * per_rank_batch * cfg["replicas"] / max(seconds)


class ThreadMemory(TorchDispatchMode):
    """Peak live bytes of storage allocated by this thread's ops (dispatch modes are thread-local)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, Any] = {}

    def _release(self, ptr: int, nbytes: int) -> None:
        self.live -= nbytes
        self._tracked.pop(ptr, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or ptr in self._tracked or storage.nbytes() == 0:
                continue  # a view or in-place result, or already counted
            self.live += storage.nbytes()
            self._tracked[ptr] = weakref.finalize(storage, self._release, ptr, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def memory_cpu(cfg: dict) -> dict:
    model = make_model(cfg)
    x, y = make_batch(cfg, cfg["global_batch"], torch.device("cpu"))
    other = chunk_sizes(cfg["global_batch"], cfg["replicas"])[1]  # the largest non-master chunk
    result = {}
    for mode in ("standard", "balanced"):
        kw = {"loss_fn": F.cross_entropy} if mode == "balanced" else {}
        dp = rw.DataParallel(model, device_ids=cfg["devices"], **kw)
        # Replica 0 runs in the caller's thread, so this peak is the master device's: its own
        # replica's work plus scatter, gather and the loss.
        with ThreadMemory() as mem:
            loss = dp(x, target=y) if mode == "balanced" else F.cross_entropy(dp(x), y)
            master = mem.peak
        loss.backward()
        # Another device's peak: the same replica work on its chunk, run in this thread.
        with ThreadMemory() as mem:
            out = model(x[:other])
            if mode == "balanced":
                out = F.cross_entropy(out, y[:other])
            replica = mem.peak
        del out
        result[mode] = {
            "master_peak_bytes": master,
            "other_replica_peak_bytes": replica,
            "master_extra_bytes": master - replica,
        }
    return result


def memory_cuda(cfg: dict) -> dict:
    devices = [torch.device(d) for d in cfg["devices"]]
    model = make_model(cfg).to(devices[0])
    x, y = make_batch(cfg, cfg["global_batch"], torch.device("cpu"))
    result = {}
    for mode in ("standard", "balanced"):
        kw = {"loss_fn": F.cross_entropy} if mode == "balanced" else {}
        dp = rw.DataParallel(model, device_ids=devices, **kw)
        base = {d: torch.cuda.memory_allocated(d) for d in devices}
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
        loss = dp(x, target=y) if mode == "balanced" else F.cross_entropy(dp(x), y.to(devices[0]))
        loss.backward()
        torch.cuda.synchronize()
        peaks = [torch.cuda.max_memory_allocated(d) - base[d] for d in devices]
        model.zero_grad(set_to_none=True)
        extra = peaks[0] - max(peaks[1:]) if len(peaks) > 1 else None
        result[mode] = {"master_extra_bytes": extra, "peak_bytes_per_device": peaks}
    return result


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--replicas", type=int, default=2, help="CPU replicas / DDP processes (CPU only)"
    )
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--in-features", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def ddp_implementations() -> dict[str, str]:
    """Strategy name -> DDP implementation: ours, and torch's beside it."""
    return {"ddp": "rankwise", "torch_ddp": "torch"}


def throughput(cfg: dict, strategies: list[str], ddp_impls: dict, repeats: int) -> dict:
    """samples/s per strategy, repeats interleaved (and rotated) across strategies."""
    runs: dict[str, list[float]] = {s: [] for s in strategies}
    for r in range(repeats):
        order = strategies[r % len(strategies) :] + strategies[: r % len(strategies)]
        for s in order:
            runs[s].append(ddp(cfg, ddp_impls[s]) if s in ddp_impls else in_process(cfg, s))
    return {
        s: {"median": round(statistics.median(v), 1), "runs": [round(x, 1) for x in v]}
        for s, v in runs.items()
    }


def memory_report(cfg: dict) -> dict:
    cuda = cfg["device"] == "cuda"
    memory = memory_cuda(cfg) if cuda else memory_cpu(cfg)
    std, bal = memory["standard"]["master_extra_bytes"], memory["balanced"]["master_extra_bytes"]
    ratio = None if not std or bal is None else bal / std
    cpu_method = "master-thread live storage (TorchDispatchMode)"
    method = "cuda.max_memory_allocated per device" if cuda else cpu_method
    return {
        "method": method,
        **memory,
        "balanced_over_standard": None if ratio is None else round(ratio, 4),
        "target_balanced_le_half_standard": None if ratio is None else ratio <= 0.5,
    }


def main() -> None:
    a = parse()
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    replicas = torch.cuda.device_count() if cuda else a.replicas
    keys = ("global_batch", "in_features", "hidden", "classes", "steps", "warmup")
    cfg = {
        "device": "cuda" if cuda else "cpu",
        "devices": [f"cuda:{i}" for i in range(replicas)] if cuda else ["cpu"] * replicas,
        "replicas": replicas,
        **{k: getattr(a, k) for k in keys},
    }
    ddp_impls = ddp_implementations()
    strategies = ["single", "dp", "dp_balanced", *(["torch_dp"] if cuda else []), *ddp_impls]
    load_before = os.getloadavg()[0]  # a shared machine: say how busy it was
    speed = throughput(cfg, strategies, ddp_impls, a.repeats)
    med = {s: v["median"] for s, v in speed.items()}
    pairs = [("dp", "single"), ("dp", "ddp"), ("ddp", "single"), ("dp_balanced", "dp")]
    pairs += [("dp", "torch_dp")] if cuda else []
    report = {
        "config": cfg,
        "ddp_impl": ddp_impls,
        "samples_per_s": speed,
        "ratios": {f"{x}_over_{y}": round(med[x] / med[y], 3) for x, y in pairs},
        "memory": memory_report(cfg),
        "torch": torch.__version__,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
