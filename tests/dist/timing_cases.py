"""The workloads and injected stragglers of tests/dist/test_timing_dist.py and
benchmarks/stragglers.py: a small GPT trained by ``rt.prepare`` under each strategy, with one
rank made slow at step ``onset`` in one of the ways a real job is slowed:

- ``input``: its data loader waits (a sleep in the collate function);
- ``compute``: a busy loop inside its backward (a hook on the loss);
- ``host``: its CPU throttled by the kernel (cgroup ``cpu.cfs_quota_us``, v1, or ``cpu.max``);
- ``memory``: it holds on to 16 MiB more every step (touched, so resident).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.models import GPT, GPT_PLAN, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, qkv_bias=False)
KINDS = ("input", "compute", "host", "memory")
WANT = {"input": "input", "compute": "compute", "host": "host", "memory": "host"}
"""The kind the attribution must name for each injection."""

_DELAY = [0.0]  # seconds the collate function sleeps (the slow rank, from the onset)


def _collate(batch):
    if _DELAY[0]:
        time.sleep(_DELAY[0])
    return torch.utils.data.default_collate(batch)


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, 64, (n, 8), generator=g),
                         torch.randint(0, 64, (n, 8), generator=g))  # fmt: skip


def _init(strategy: str):
    if strategy == "tensor":
        return rw.init(mesh={"tensor": int(os.environ["WORLD_SIZE"])})
    if strategy == "pipeline":
        return rw.init(mesh={"pipeline": 2})
    if strategy == "dp":
        return rw.init(strategy="dp", devices=["cpu", "cpu"])
    return rw.init(strategy=strategy)


def _prepared(rt, strategy: str, steps: int):
    torch.manual_seed(0)
    model = GPT(CFG)
    if strategy == "tensor":
        model = rw.tensor_parallel(model, GPT_PLAN, group=rt.mesh.group("tensor"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(_data(8 * steps), batch_size=4, collate_fn=_collate)
    extra = {"microbatches": 2} if strategy == "pipeline" else {}
    return rt.prepare(model, opt, loader, **extra)


def _loss(rt, strategy: str, model, x, y) -> torch.Tensor:
    if strategy == "tensor":
        return rw.vocab_parallel_cross_entropy(model(x)[0], y, rt.mesh.group("tensor"))
    if strategy == "pipeline":
        return model(x, y)[1]
    logits = model(x)[0]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train(strategy: str, steps: int, inject: str | None = None, slow: int = 1,
          onset: int = 10, extra: float = 0.15) -> int:
    """``steps`` steps of the README loop; from ``onset``, rank ``slow`` is slowed by
    ``inject``. Returns this rank."""
    torch.set_num_threads(1)
    rt = _init(strategy)
    model, opt, loader = _prepared(rt, strategy, steps)
    mine = inject is not None and rt.rank == slow
    held, step = [], 0
    with contextlib.ExitStack() as undo:
        for x, y in loader:
            if mine and step == onset:
                _start(inject, extra, undo)
            loss = _loss(rt, strategy, model, x, y)
            if mine and inject == "compute" and step >= onset:
                loss.register_hook(lambda g: _busy(extra))  # inside backward, on this rank
            loss.backward()
            opt.step()
            opt.zero_grad()
            if mine and inject == "memory" and step >= onset:
                held.append(torch.ones(4 << 20))  # 16 MiB, written: resident
            step += 1
            if step == steps:
                break
    rank = rt.rank
    rw.shutdown()
    return rank


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _start(inject: str, extra: float, undo: contextlib.ExitStack) -> None:
    if inject == "input":
        _DELAY[0] = extra
        undo.callback(_DELAY.__setitem__, 0, 0.0)
    elif inject == "host":
        undo.enter_context(throttled(os.getpid(), 0.05))


def cpu_cgroup_root() -> Path | None:
    """Where a CPU cgroup can be made here (v1 ``cpu`` or v2 with ``cpu.max``), else None."""
    for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")):
        if (root / "cpu.cfs_quota_us").exists() or (root / "cgroup.subtree_control").exists():
            if os.access(root, os.W_OK):
                return root
    return None


@contextlib.contextmanager
def throttled(pid: int, share: float):
    """Process ``pid`` limited to ``share`` of one CPU by the kernel while the block runs."""
    root = cpu_cgroup_root()
    if root is None:
        raise RuntimeError("no writable CPU cgroup here (needs root and cgroup cpu)")
    group = root / f"rankwise-throttle-{pid}"
    group.mkdir(exist_ok=True)
    period = 100_000
    if (root / "cpu.cfs_quota_us").exists():
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(int(share * period)))
    else:
        (group / "cpu.max").write_text(f"{int(share * period)} {period}")
    (group / "cgroup.procs").write_text(str(pid))
    try:
        yield
    finally:
        for tid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(tid)
        with contextlib.suppress(OSError):
            group.rmdir()
