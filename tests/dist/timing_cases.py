"""The workloads and injected stragglers of tests/dist/test_timing_dist.py and
benchmarks/stragglers.py: a small GPT trained by ``rt.prepare`` under each strategy, with one
rank made slow at step ``onset`` in one of the ways a real job is slowed:

- ``input``: its data loader waits (a sleep in the collate function);
- ``compute``: a busy loop inside its backward (a hook on the loss);
- ``host``: its CPU throttled by the kernel (cgroup ``cpu.cfs_quota_us``, v1, or ``cpu.max``);
- ``memory``: it holds on to 16 MiB more every step (written, so resident; mappings of its
  own, given back at the episode's end);
- ``link``: its node's link slowed (on the namespace cluster: ``tc tbf`` on both ends of the
  node's link, the commands handed over in ``RANKWISE_TEST_LINK`` as JSON ``{"<rank>": [[on
  argv...], [off argv...]]}``, run by the slow rank at the episode's start and end).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.models import GPT, GPT_PLAN, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=32, qkv_bias=False)
KINDS = ("input", "compute", "host", "memory")
WANT = {"input": "input", "compute": "compute", "host": "host", "memory": "host",
        "link": "communication"}
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
    # Enough batches for ``steps`` steps on every rank, however many share the data.
    loader = DataLoader(_data(4 * steps * max(2, rt.world_size)), batch_size=4,
                        collate_fn=_collate)  # fmt: skip
    extra = {"microbatches": 2} if strategy == "pipeline" else {}
    return rt.prepare(model, opt, loader, **extra)


def _loss(rt, strategy: str, model, x, y) -> torch.Tensor:
    if strategy == "tensor":
        return rw.vocab_parallel_cross_entropy(model(x)[0], y, rt.mesh.group("tensor"))
    if strategy == "pipeline":
        return model(x, y)[1]
    logits = model(x)[0]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train(strategy: str, steps: int, inject: str | None = None,
          episodes: tuple[tuple[int, int, int], ...] = (), log_dir: str | None = None) -> int:
    """``steps`` steps of the README loop; in each episode ``(start, end, rank)`` that rank
    is slowed by ``inject`` from step ``start`` to ``end``; ``log_dir``: ``rt.log`` the loss
    there (CSV). Returns this rank."""
    torch.set_num_threads(1)
    rt = _init(strategy)
    model, opt, loader = _prepared(rt, strategy, steps)
    if log_dir is not None:
        rt.log_to(log_dir, log_with=["csv"])
    mine = [(a, b) for a, b, r in episodes if r == rt.rank and inject is not None]
    held: list[mmap.mmap] = []
    undo = contextlib.ExitStack()
    for step, (x, y) in enumerate(loader):
        sick = any(a <= step < b for a, b in mine)
        if any(step == a for a, _ in mine):
            _start(inject, undo)
        if any(step == b for _, b in mine):
            undo.close()
            held.clear()
        loss = _loss(rt, strategy, model, x, y)
        if sick and inject == "compute":
            loss.register_hook(lambda g: _busy(EXTRA))  # inside backward, on this rank
        loss.backward()
        opt.step()
        opt.zero_grad()
        if log_dir is not None:
            rt.log({"loss": loss.item()})
        if sick and inject == "memory":
            held.append(_resident(16 << 20))
        if step + 1 == steps:
            break
    undo.close()
    rank = rt.rank
    rw.shutdown()
    return rank


EXTRA = 0.15
"""Seconds a slow rank's data wait or backward gains per step."""


def _resident(size: int) -> mmap.mmap:
    """``size`` bytes of fresh memory, written (resident), its own mapping: given back to the
    system when dropped. (Memory from malloc would stay with the process after the episode,
    and a later episode on the same rank reuse it without growing.)"""
    m = mmap.mmap(-1, size)
    torch.frombuffer(m, dtype=torch.uint8).fill_(1)
    return m


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _start(inject: str | None, undo: contextlib.ExitStack) -> None:
    if inject == "input":
        _DELAY[0] = EXTRA
        undo.callback(_DELAY.__setitem__, 0, 0.0)
    elif inject == "host":
        undo.enter_context(throttled(os.getpid(), 0.05))
    elif inject == "link":
        on, off = json.loads(os.environ["RANKWISE_TEST_LINK"])[os.environ["RANK"]]
        for argv in on:
            subprocess.run(argv, check=True, capture_output=True, timeout=30)
        for argv in off:
            undo.callback(subprocess.run, argv, capture_output=True, timeout=30)


def cpu_cgroup_root() -> Path | None:
    """Where a CPU cgroup can be made here (v1 ``cpu`` or v2 with ``cpu.max``), else None."""
    for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")):
        v1, v2 = root / "cpu.cfs_quota_us", root / "cgroup.subtree_control"
        if (v1.exists() or v2.exists()) and os.access(root, os.W_OK):
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
