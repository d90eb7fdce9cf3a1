"""A model larger than one process, phase by phase: peak memory per rank from the build to the
load of its checkpoint, rankwise zero3 (eager and meta builds) beside torch FSDP2 + DCP.

    flock /tmp/bench.lock python benchmarks/bigmodel.py --world 2 --world 4      # 8 x 4096
    python benchmarks/bigmodel.py --world 2 --world 4 --size 1024 --out /tmp/bigmodel.json

The model is ``--layers`` x ``nn.Linear(size, size)`` (8 x 4096: 134M parameters, P = 0.50 GiB
fp32), AdamW built over ``model.parameters()`` before preparing, as users write. Each variant
runs in a fresh group of ``--world`` spawned ranks (Gloo, CPU), once per world size:

- ``rankwise-eager``: built on the CPU, ``rt.prepare`` under ``strategy="zero3"``;
- ``rankwise-meta``: built under ``torch.device("meta")``, ``rt.prepare`` (reset_parameters);
- ``rankwise-meta-exact``: the same with ``exact_init=True`` (equal to the eager build);
- ``fsdp2-eager``: torch's ``fully_shard`` per layer and on the root, on the CPU-built model;
- ``fsdp2-meta``: ``fully_shard`` on the meta model, ``to_empty``, ``reset_parameters()``.

Phases: **build**, **prepare**, **steps** (2 AdamW steps on a batch of 8), **save**, **load**.
rankwise saves with ``rt.save(dir, sharded=True)`` (every rank writes its shards, DCP's
format: the default under zero3) and loads it back with ``rt.load``; it also saves and loads
one file, ``sharded=False`` (the shards gathered, rank 0 writes): **save_single**,
**load_single**. FSDP2 saves and loads with ``torch.distributed.checkpoint`` over
``get_state_dict`` (torch's recipe). Each format is saved and loaded ``--repeats`` times (a
new folder each time): the median time, the highest peak. Between save and load every
tensor the optimizer holds (its parameters and its state) is overwritten with NaN and the
saved files are dropped from the page cache (every load reads the disk, as a restart does);
after the load each is compared byte for byte with what was saved: ``load_mismatched`` counts the tensors that differ (0 when
the load restores the saved state), ``scrambled`` those the NaN fill changed (all of them).

Per phase and rank: the resident-set high-water mark above what the process held before the
build (``VmHWM`` reset through ``/proc/self/clear_refs``; allocations over 1 MiB served by
mmap, so freed memory leaves the count at once; a tiny model goes through every phase first,
so one-time set-up is not counted), what is still resident when it ends (``after_P``), and
the phase's wall time. Max over ranks, in MiB and in units of P (``peak_P``), and the
checkpoints' size on disk; ``worst_phase_P``: the highest peak of the five phases. Pages of
shared memory (zero3 keeps its units there when every rank is on one machine) count whole in
every rank's resident set: ``shared_mb`` is how many the rank held at the phase's end (they are
never freed, so they were there at its peak), and ``proportional_peak_P`` counts 1/N of them,
as the proportional set size does (``worst_phase_proportional_P``: its highest phase). Prints
JSON and writes ``benchmarks/results/bigmodel.json`` (or ``--out``).
``benchmarks/bigmodel_build.py`` is the build and prepare phases alone.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit
from bigmodel_build import VARIANTS, _exact_rss, _model, _prepare

import rankwise as rw
from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.testing import run_distributed

BATCH = 8
STEPS = 2
PHASES = ("build", "prepare", "steps", "save", "load")
SINGLE = ("save_single", "load_single")  # rankwise only: the one-file format


class _Meter:
    """Each phase's peak resident memory above ``base`` (the process before the build) and
    its wall time on this rank; every rank starts a phase together."""

    def __init__(self) -> None:
        self.base = 0
        self.runs: dict[str, list[dict[str, float]]] = {}

    def start(self) -> None:
        gc.collect()
        _trim_heap()
        self.base = _status_kb("VmRSS")

    @contextlib.contextmanager
    def __call__(self, phase: str):
        gc.collect()
        _trim_heap()
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # high-water mark := now
        began = time.perf_counter()
        yield
        took = time.perf_counter() - began
        gc.collect()
        self.runs.setdefault(phase, []).append({
            "peak_mb": (_status_kb("VmHWM") - self.base) / 1024, "s": took,
            "after_mb": (_status_kb("VmRSS") - self.base) / 1024,
            "shared_mb": _status_kb("RssShmem") / 1024})  # fmt: skip
        dist.barrier()

    @property
    def rows(self) -> dict[str, dict[str, float]]:
        """Per phase over its repeats: the highest peak, the median time, what the last left."""
        return {phase: {"peak_mb": max(r["peak_mb"] for r in runs),
                        "s": statistics.median(r["s"] for r in runs),
                        "after_mb": runs[-1]["after_mb"],
                        "shared_mb": max(r["shared_mb"] for r in runs)}
                for phase, runs in self.runs.items()}  # fmt: skip


def _build(variant: str, size: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    with torch.device("meta") if "meta" in variant else contextlib.nullcontext():
        return _model(size, layers)


def _prepared(variant: str, rt, model: nn.Sequential) -> tuple[nn.Module, torch.optim.Optimizer]:
    kept = _prepare(variant, rt, model)
    return (model, kept) if variant.startswith("fsdp2") else kept


def _step(variant: str, rt, model, opt, size: int) -> None:
    x = torch.randn(BATCH, size, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = F.mse_loss(model(x), x)
    loss.backward() if variant.startswith("fsdp2") else rt.backward(loss)
    opt.step()
    opt.zero_grad()


def _held(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer holds, this rank's part: its parameters, then its state."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = [v for p in params for _, v in sorted(opt.state.get(p, {}).items())]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in params + state]
    return [t for t in local if isinstance(t, torch.Tensor)]


def _digests(opt: torch.optim.Optimizer) -> list[bytes]:
    return [hashlib.blake2b(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()).digest()
            for t in _held(opt)]  # fmt: skip


def _scramble(opt: torch.optim.Optimizer, saved: list[bytes]) -> int:
    """NaN into every held tensor, so a load that restores nothing is seen; how many changed."""
    with torch.no_grad():
        for t in _held(opt):
            t.fill_(float("nan"))
    return sum(a != b for a, b in zip(saved, _digests(opt), strict=True))


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


def _formats(variant: str, rt, folder: Path, repeat: int) -> dict[str, tuple]:
    """Per format: (save phase, load phase, where, save(model, opt), load(model, opt)); each
    repeat saves to a new place."""
    if variant.startswith("fsdp2"):
        where = folder / f"dcp-{repeat}"
        return {"dcp": ("save", "load", where, lambda m, o: _dcp(where, m, o, load=False),
                        lambda m, o: _dcp(where, m, o, load=True))}  # fmt: skip
    out = {}
    for name, save, load, sharded in (("sharded", "save", "load", True),
                                      ("single", "save_single", "load_single", False)):  # fmt: skip
        where = folder / f"{name}-{repeat}{'.pt' if name == 'single' else ''}"
        out[name] = (save, load, where,
                     lambda m, o, w=where, s=sharded: rt.save(w, model=m, optimizer=o, sharded=s),
                     lambda m, o, w=where: rt.load(w, model=m, optimizer=o))  # fmt: skip
    return out


def _files(path: Path) -> list[Path]:
    """The files of a checkpoint: a folder's, or the one file."""
    return [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in _files(path) if p.exists()) / 2**20


def _run(variant: str, rt, size: int, layers: int, folder: Path, meter: _Meter,
         repeats: int) -> dict:  # fmt: skip
    """Every phase, measured by ``meter`` (save and load ``repeats`` times); the checks of
    each format's round trips."""
    meter.start()
    with meter("build"):
        model = _build(variant, size, layers)
    dist.barrier()
    with meter("prepare"):
        model, opt = _prepared(variant, rt, model)
    with meter("steps"):
        for _ in range(STEPS):
            _step(variant, rt, model, opt, size)
    checks: dict[str, dict] = {}
    for repeat in range(repeats):
        for name, ways in _formats(variant, rt, folder, repeat).items():
            check = _round_trip(model, opt, meter, *ways)
            if name in checks:  # every round trip counts: the fewest scrambled, all mismatches
                check["scrambled"] = min(check["scrambled"], checks[name]["scrambled"])
                check["load_mismatched"] += checks[name]["load_mismatched"]
            checks[name] = check
    return checks


def _round_trip(model, opt, meter: _Meter, save_phase: str, load_phase: str, where: Path,
                save, load) -> dict:  # fmt: skip
    """Save, NaN into every held tensor, load: is every tensor back as it was saved?"""
    saved = _digests(opt)
    with meter(save_phase):
        save(model, opt)
    scrambled = _scramble(opt, saved)
    _evict(where)
    with meter(load_phase):
        load(model, opt)
    mismatched = sum(a != b for a, b in zip(saved, _digests(opt), strict=True))
    return {"size_mb": _size_mb(where), "tensors": len(saved), "scrambled": scrambled,
            "load_mismatched": mismatched}  # fmt: skip


def _evict(path: Path) -> None:
    """Drop the saved files from the page cache, so every load reads from the disk as a
    restart does: rankwise writes its shard files around the cache, DCP's stay in it, and a
    load of cached files against one from the disk compares nothing but the cache."""
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _one(variant: str, size: int, layers: int, folder: str, repeats: int = 1) -> dict:
    rt = rw.init(strategy="zero3")
    torch.set_num_threads(1)
    _exact_rss()
    # A tiny model through every phase first: what the first collectives and the first saves
    # set up once (Gloo's buffers, the saves' process group) is not the model's cost.
    _run(variant, rt, 64, 2, Path(folder) / "warm-up", _Meter(), 1)
    meter = _Meter()
    checks = _run(variant, rt, size, layers, Path(folder) / "measured", meter, repeats)
    return {"phases": meter.rows, "checks": checks}


def _merge(ranks: list[dict], p_mb: float) -> dict:
    """Max over ranks (the fullest rank, the slowest); check counts summed over ranks."""
    row: dict = {}
    n = len(ranks)
    for phase in ranks[0]["phases"]:
        peak = max(r["phases"][phase]["peak_mb"] for r in ranks)
        after = max(r["phases"][phase]["after_mb"] for r in ranks)
        # Shared-memory pages (zero3's units on one machine) count whole in every rank's
        # resident set; the proportional peak counts each rank's 1/N of them.
        own = max(r["phases"][phase]["peak_mb"] - r["phases"][phase]["shared_mb"] * (n - 1) / n
                  for r in ranks)  # fmt: skip
        shared = max(r["phases"][phase]["shared_mb"] for r in ranks)
        row[phase] = {"peak_mb": round(peak, 1), "peak_P": round(peak / p_mb, 2),
                      "after_P": round(after / p_mb, 2), "shared_mb": round(shared, 1),
                      "proportional_peak_P": round(own / p_mb, 2),
                      "s": round(max(r["phases"][phase]["s"] for r in ranks), 3)}  # fmt: skip
    for name, check in ranks[0]["checks"].items():
        row[f"checkpoint_{name}"] = {
            "size_mb": round(check["size_mb"], 1),
            **{k: sum(r["checks"][name][k] for r in ranks)
               for k in ("tensors", "scrambled", "load_mismatched")},
        }  # fmt: skip
    main = [row[p]["peak_P"] for p in PHASES]
    row["worst_phase_P"] = max(main)
    row["worst_phase_proportional_P"] = max(row[p]["proportional_peak_P"] for p in PHASES)
    return row


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, action="append", help="world sizes (default 2, 4)")
    ap.add_argument("--size", type=int, default=4096, help="width of each Linear (default 4096)")
    ap.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3, help="saves and loads per format (3)")
    ap.add_argument("--timeout", type=float, default=3600, help="per spawned group, seconds")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bigmodel.json"))
    args = ap.parse_args(argv)
    args.world = args.world or [2, 4]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    small = [(k, v) for k, v in vars(args).items() if k in ("size", "layers", "repeats") and v < 1]
    if unknown or any(w < 2 for w in args.world) or small:
        ap.error(f"--variants from {','.join(VARIANTS)} (got {unknown}); --world >= 2 "
                 f"(got {args.world}); --size, --layers, --repeats >= 1 (got {small})")  # fmt: skip
    return args


def _table(world: int, rows: dict) -> None:
    print(f"world {world}: peak per rank, P  " + "  ".join(f"{p:>11}" for p in PHASES + SINGLE))
    for variant, row in rows.items():
        cells = [f"{row[p]['peak_P']:>11}" if p in row else f"{'-':>11}" for p in PHASES + SINGLE]
        print(f"  {variant:<28} " + "  ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    p_mb = args.layers * (args.size * args.size + args.size) * 4 / 2**20
    result = {"benchmark": "bigmodel", "layers": args.layers, "size": args.size,
              "parameters": args.layers * (args.size * args.size + args.size),
              "P_mb": round(p_mb, 1), "steps": STEPS, "batch": BATCH, "repeats": args.repeats,
              "threads_per_rank": 1,
              "load_note": "2 shared CPU cores; smoke figures are taken under load",
              "worlds": {}}  # fmt: skip
    for world in args.world:
        rows = {}
        for variant in args.variants:
            folder = tempfile.mkdtemp(prefix=f"bigmodel-w{world}-")
            try:
                ranks = run_distributed(_one, world, args=(variant, args.size, args.layers,
                                        folder, args.repeats), init=False,
                                        timeout=args.timeout)  # fmt: skip
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            rows[variant] = _merge(ranks, p_mb)
        _table(world, rows)
        result["worlds"][str(world)] = rows
    return emit(result, args.out)


if __name__ == "__main__":
    main()
