"""Sharded checkpoints: save and load wall time and peak memory per rank, three ways, and the
cost of a background save to the training steps it overlaps.

    flock /tmp/bench.lock python benchmarks/checkpoint_sharded.py --world 2 --world 4
    python benchmarks/checkpoint_sharded.py --world 2 --size 1024 --out /tmp/smoke.json  # smoke

One spawned group per ``--world``; in each rank a model of ``--layers`` x
``Linear(--size, --size)`` (8 x 4096: 134M parameters, 0.5 GiB fp32) with AdamW after one step:

- ``rankwise-sharded``: a ZeRO-3 model (``rw.ShardedDataParallel``, one unit per layer),
  ``rw.save_checkpoint(..., sharded=True)``: every rank writes its shards in parallel (DCP's
  format); loaded back with ``rw.load_checkpoint`` (each rank reads its shards);
- ``rankwise-single``: the same model, today's one file (every rank's shards gathered, rank 0
  writes; every rank reads the file and keeps its slice);
- ``torch-fsdp2-dcp``: torch's FSDP2 (``fully_shard`` per layer and the root) with
  ``dcp.save``/``dcp.load`` of ``get_state_dict`` (torch's DCP tutorial), into the same folder
  each time: DCP truncates and rewrites its files in place;
- ``torch-fsdp2-dcp-fresh``: the same into a new folder each time, the previous one deleted
  after (``_FreshDCP``): the disk pattern of our atomic save, which writes new files and never
  touches the checkpoint it replaces until the new one is complete (on this machine's virtual
  disk, writing freshly allocated blocks costs more than rewriting just-freed ones);
- ``background``: the ZeRO-3 model's step time while ``rt.save(..., background=True)`` writes
  (the steps that overlap the thread) against its normal step time (five steps just before),
  in three rounds (the median ratio, and each round's); beside it the floor, the steps while a
  bare thread writes the same bytes (``O_DIRECT`` from one buffer: the disk's own cost, with no
  serialising or hashing) in the same round; and how long the call took to return (staging to host memory; after a first background save, which also makes
  the saves' process group).

Each way is saved and loaded once unmeasured, then ``--repeats`` times (ours sharded and DCP
alternating, both models alive, the order reversed every other round): seconds are the median
of the slowest rank's wall time; **peak MB** is a rank's resident-set high-water mark
during the operation above what it held just before (``VmHWM`` reset with
``/proc/self/clear_refs``; allocations over 1 MiB served by mmap), the max over ranks;
``step_peak_mb`` is the same for one training step. CPU (Gloo) only. Prints JSON and writes
``benchmarks/results/checkpoint_sharded.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.testing import run_distributed

BATCH = 8


def _net(size: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(size, size) for _ in range(layers)))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _step(model, opt, size: int) -> None:
    x = torch.randn(BATCH, size, generator=torch.Generator().manual_seed(dist.get_rank()))
    F.mse_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad()


def _measured(fn) -> dict:
    """Run ``fn`` on every rank at once: its wall time and this rank's peak above now."""
    gc.collect()
    _trim_heap()
    dist.barrier()
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    peak = (_status_kb("VmHWM") - before) / 1024
    dist.barrier()
    return {"s": took, "peak_mb": peak}


def _zero3(size: int, layers: int):
    model = rw.ShardedDataParallel(_net(size, layers), _adamw, stage=3, wrap={nn.Linear})
    _step(model, model.optimizer, size)
    return model, model.optimizer


def _fsdp2(size: int, layers: int):
    from torch.distributed.fsdp import fully_shard

    net = _net(size, layers)
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    opt = _adamw(net.parameters())
    _step(net, opt, size)
    return net, opt


def _dcp(folder: Path, model, opt, load: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if not load:
        dcp.save(state, checkpoint_id=folder)
        return
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


class _FreshDCP:
    """``dcp.save`` into a new folder each time, the previous one deleted after it (what
    ``keep_last=1`` does): the write pattern of an atomic save, which never overwrites the
    checkpoint it replaces. ``dcp.save`` into the same folder truncates and rewrites its files
    in place, reusing the disk blocks just freed."""

    def __init__(self, root: Path, model, opt) -> None:
        self.root, self.model, self.opt, self.count = root, model, opt, 0

    def path(self) -> Path:
        return self.root / f"dcp-fresh-{self.count}"

    def save(self) -> None:
        self.count += 1
        _dcp(self.path(), self.model, self.opt, load=False)
        dist.barrier()  # every rank wrote: the previous checkpoint may go
        if dist.get_rank() == 0:
            shutil.rmtree(self.root / f"dcp-fresh-{self.count - 1}", ignore_errors=True)

    def load(self) -> None:
        _dcp(self.path(), self.model, self.opt, load=True)


def _size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def _timed(ways: dict[str, tuple], repeats: int) -> dict:
    """Per way ``(save, load, where)`` (``where``: a path, or what returns it): one warm-up save and load, then ``repeats`` measured
    saves of every way in turn (the order reversed every other round, so the disk's state and
    writeback hit each way alike), then the loads the same way; medians of the times, the
    highest peaks."""
    for save, load, _ in ways.values():
        save()
        load()
    runs: dict[str, dict[str, list]] = {name: {"save": [], "load": []} for name in ways}
    for op in ("save", "load"):
        for r in range(repeats):
            for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                save, load, _ = ways[name]
                runs[name][op].append(_measured(save if op == "save" else load))
    return {name: {**{op: {"s": statistics.median(m["s"] for m in ms),
                           "peak_mb": max(m["peak_mb"] for m in ms)}
                      for op, ms in runs[name].items()},
                   "size_mb": _size_mb(ways[name][2]() if callable(ways[name][2])
                                       else ways[name][2])}
            for name in ways}  # fmt: skip


def _rows(root: Path, size: int, layers: int, repeats: int) -> dict:
    out = {}
    model, opt = _zero3(size, layers)
    out["step"] = _measured(lambda: _step(model, opt, size))
    net, net_opt = _fsdp2(size, layers)  # alive beside ours: their saves alternate
    ways = {}
    for name, sharded, where in (("rankwise-sharded", True, root / "sharded"),
                                 ("rankwise-single", False, root / "single.pt")):  # fmt: skip
        save = functools.partial(rw.save_checkpoint, where, model=model, optimizer=opt,
                                 sharded=sharded, keep_last=1)  # fmt: skip
        load = functools.partial(rw.load_checkpoint, where, model=model, optimizer=opt)
        ways[name] = (save, load, where)
    ways["torch-fsdp2-dcp"] = (functools.partial(_dcp, root / "dcp", net, net_opt, load=False),
                               functools.partial(_dcp, root / "dcp", net, net_opt, load=True),
                               root / "dcp")  # fmt: skip
    fresh = _FreshDCP(root, net, net_opt)
    ways["torch-fsdp2-dcp-fresh"] = (fresh.save, fresh.load, fresh.path)
    alternating = ("rankwise-sharded", "torch-fsdp2-dcp", "torch-fsdp2-dcp-fresh")
    out.update(_timed({k: ways[k] for k in alternating}, repeats))
    out.update(_timed({"rankwise-single": ways["rankwise-single"]}, repeats))
    del ways, fresh, net, net_opt
    out["background"] = _background(root / "background", model, opt, size)
    return out


def _steps_while(model, opt, size: int, busy) -> list[float]:
    """Training steps while ``busy()`` on any rank (a step is a collective: the ranks agree
    to take one more); each one's seconds."""
    during: list[float] = []
    while len(during) < 50:
        flag = torch.tensor([1.0 if busy() else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:
            break
        t0 = time.perf_counter()
        _step(model, opt, size)
        during.append(time.perf_counter() - t0)
    return during


def _bare_write(path: Path, nbytes: int) -> threading.Thread:
    """A thread writing ``nbytes`` from one buffer with O_DIRECT, then fsync: the disk's own
    cost to the steps, with no serialising, hashing or copying (the floor under ours)."""

    def write() -> None:
        buf = mmap.mmap(-1, 4 << 20)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0))
        for _ in range(-(-nbytes // len(buf))):
            os.write(fd, buf)
        os.fsync(fd)
        os.close(fd)
        buf.close()

    thread = threading.Thread(target=write)
    thread.start()
    return thread


def _background(folder: Path, model, opt, size: int, rounds: int = 3) -> dict:
    rt = rw.get_runtime()
    # The first background save also makes the saves' own process group: not measured.
    rt.save(folder / "warm-up", model=model, optimizer=opt, background=True, sharded=True).wait()
    out: dict = {"normal_step_s": [], "during_step_s": [], "steps_during": [], "returned_s": [],
                 "total_s": [], "bare_during_step_s": []}  # fmt: skip
    for r in range(rounds):
        os.sync()  # the earlier saves' writeback is over: what slows the steps is this save's
        normal = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            _step(model, opt, size)
            normal.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        pending = rt.save(folder / f"round-{r}", model=model, optimizer=opt, background=True,
                          sharded=True)  # fmt: skip
        returned = time.perf_counter() - start
        during = _steps_while(model, opt, size, lambda p=pending: not p.done())
        pending.wait()
        total = time.perf_counter() - start
        mine = sum(f.stat().st_size for f in (folder / f"round-{r}").rglob(
            f"__{dist.get_rank()}_*.distcp"))  # fmt: skip
        assert mine > 0, f"no shard file of rank {dist.get_rank()} in round-{r}"
        os.sync()
        bare = _bare_write(folder / f"bare-{dist.get_rank()}", mine)
        bare_during = _steps_while(model, opt, size, bare.is_alive)
        bare.join()
        (folder / f"bare-{dist.get_rank()}").unlink()
        for key, value in (("normal_step_s", statistics.median(normal)),
                           ("during_step_s", statistics.median(during) if during else None),
                           ("steps_during", len(during)), ("returned_s", returned),
                           ("total_s", total),
                           ("bare_during_step_s",
                            statistics.median(bare_during) if bare_during else None)):  # fmt: skip
            out[key].append(value)
    return out


def _rank(folder: str, size: int, layers: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError, TypeError):
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    return _rows(Path(folder), size, layers, repeats)


def _merge(ranks: list[dict]) -> dict:
    """Max over ranks of every time and peak (the slowest rank; the fullest)."""
    first = ranks[0]
    out: dict = {"step_peak_mb": round(max(r["step"]["peak_mb"] for r in ranks), 1),
                 "step_s": round(max(r["step"]["s"] for r in ranks), 3)}  # fmt: skip
    for name in ("rankwise-sharded", "rankwise-single", "torch-fsdp2-dcp",
                 "torch-fsdp2-dcp-fresh"):
        row = {"size_mb": round(first[name]["size_mb"], 1)}
        for op in ("save", "load"):
            row[f"{op}_s"] = round(max(r[name][op]["s"] for r in ranks), 3)
            row[f"{op}_peak_mb"] = round(max(r[name][op]["peak_mb"] for r in ranks), 1)
        out[name] = row
    bg = [r["background"] for r in ranks]
    rounds = len(bg[0]["normal_step_s"])
    # Per round, the slowest rank's normal step and its slowest step during the save.
    normal = [max(b["normal_step_s"][i] for b in bg) for i in range(rounds)]
    during = [max((b["during_step_s"][i] for b in bg if b["during_step_s"][i] is not None),
                  default=None) for i in range(rounds)]  # fmt: skip
    ratios = [round(d / n, 3) for d, n in zip(during, normal, strict=True) if d is not None]
    bare = [max((b["bare_during_step_s"][i] for b in bg if b["bare_during_step_s"][i]),
                default=None) for i in range(rounds)]  # fmt: skip
    bare_ratios = [round(d / n, 3) for d, n in zip(bare, normal, strict=True) if d is not None]
    out["background"] = {
        "normal_step_s": round(statistics.median(normal), 3),
        "during_step_s": round(statistics.median(d for d in during if d is not None), 3)
        if ratios else None,
        "during_over_normal": round(statistics.median(ratios), 3) if ratios else None,
        "during_over_normal_rounds": ratios,
        # The floor: the same bytes written bare (O_DIRECT from one buffer) in the same round.
        "bare_write_over_normal": round(statistics.median(bare_ratios), 3) if bare_ratios else None,
        "bare_write_over_normal_rounds": bare_ratios,
        "steps_during": [min(b["steps_during"][i] for b in bg) for i in range(rounds)],
        "returned_s": round(max(max(b["returned_s"]) for b in bg), 3),
        "total_s": round(statistics.median(max(b["total_s"][i] for b in bg)
                                           for i in range(rounds)), 3),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, action="append", help="world sizes (default 2, 4)")
    parser.add_argument("--size", type=int, default=4096, help="Linear width (default 4096)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measured saves and loads per way, after a warm-up (default 3)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "checkpoint_sharded.json"))  # fmt: skip
    args = parser.parse_args()
    worlds = args.world or [2, 4]
    params = args.layers * (args.size * args.size + args.size)
    result = {"config": {"size": args.size, "layers": args.layers, "parameters": params,
                         "param_mib": round(params * 4 / 2**20, 1), "batch": BATCH, "repeats": args.repeats,
                         "threads_per_rank": 1}, "worlds": {},
              "load_before": list(os.getloadavg()), "cores": os.cpu_count()}  # fmt: skip
    for world in worlds:
        folder = tempfile.mkdtemp(prefix=f"ckpt-bench-w{world}-")
        try:
            ranks = run_distributed(_rank, world, args=(folder, args.size, args.layers,
                                                        args.repeats), timeout=3600)  # fmt: skip
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        result["worlds"][str(world)] = _merge(ranks)
    result["load_after"] = list(os.getloadavg())  # 1, 5, 15 min: quiet when near 2 (the ranks)
    emit(result, args.out)


if __name__ == "__main__":
    main()
