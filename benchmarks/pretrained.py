"""Peak memory per rank: a Hugging Face checkpoint loaded into ZeRO-3 shards, and exported.

    flock /tmp/bench.lock python benchmarks/pretrained.py              # GPT-2 124M, world 2
    python benchmarks/pretrained.py --small                            # 4M: a smoke run

The parent builds a GPT-2 from its config (no download) and writes it with HF's
``save_pretrained`` (``--shard`` MB per file). Then, in fresh spawned processes (world
``--world``, ``strategy="zero3"``, Gloo, one thread per rank), each phase is measured on its own:

- **from_pretrained + prepare** (today's way): ``GPT2LMHeadModel.from_pretrained(dir)``, then
  ``rt.prepare``;
- **load_pretrained**: the model built from the config and prepared (eagerly: every rank
  builds it whole, then shards it), then ``rt.load_pretrained(model, dir)``; the peak of the
  load call alone is reported, and of the three steps together;
- **meta build + prepare + load_pretrained** (once ``rt.prepare`` takes meta-device models):
  the model built under ``torch.device("meta")``, prepared (each rank materializes its shard
  only, initialised by HF's ``_init_weights``), then loaded;
- **save_pretrained** (streamed, one unit gathered at a time, rank 0 writes) vs today's
  **state_dict + save_file** (the consolidated state on every rank, written by rank 0).

**peak MB** is the resident-set high-water mark during the phase above what the process held
when it began (``VmHWM`` reset through ``/proc/self/clear_refs``; allocations over 1 MiB served
by mmap so freed memory leaves the count). It includes the file pages a rank touched through
safetensors' memory map. ``shard MB`` is what the rank keeps of the parameters; ``largest MB``
the largest tensor: the load's target is at most shard + one tensor (its slice, in fact).

Prints one JSON object and writes ``benchmarks/results/pretrained.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import rankwise as rw
from rankwise.bench.memory import _status_kb, _trim_heap
from rankwise.testing import run_distributed

FULL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, n_positions=1024)
SMALL = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=128)


def _config(size: dict):
    from transformers import GPT2Config

    return GPT2Config(**size, bos_token_id=0, eos_token_id=0)


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _exact_rss() -> None:
    """Allocations over 1 MiB served by mmap: freed tensors leave the resident set at once."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _measured(fn: Callable[[], object]) -> tuple[object, dict]:
    """``fn()`` with the rank's peak resident MB above its start, and its wall seconds."""
    gc.collect()
    _trim_heap()
    dist.barrier()
    base = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := now
    t0 = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - t0
    dist.barrier()
    return value, {"peak_mb": round((_status_kb("VmHWM") - base) / 1024, 1),
                   "seconds": round(seconds, 2)}  # fmt: skip


def _shard_mb(model) -> float:
    return round(sum(u.shard.numel() * u.shard.element_size() for u in model.units) / 2**20, 1)


def _today(folder: str, size: dict) -> dict:
    """from_pretrained + prepare, then the consolidated state written by rank 0."""
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(1)
    _exact_rss()
    _quiet()
    rt = rw.init(strategy="zero3")

    def load():
        model = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)
        return rt.prepare(model, torch.optim.AdamW(model.parameters()))

    (model, _), load_row = _measured(load)

    def export():
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        if rt.rank == 0:
            save_file(state, str(Path(folder) / "today.safetensors"), metadata={"format": "pt"})

    _, save_row = _measured(export)
    return {"from_pretrained + prepare": load_row, "state_dict + save_file": save_row,
            "shard_mb": _shard_mb(model)}  # fmt: skip


def _ours(folder: str, size: dict) -> dict:
    """Build + prepare, load_pretrained (measured alone too), save_pretrained."""
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(1)
    _exact_rss()
    _quiet()
    rt = rw.init(strategy="zero3")
    holder = {}

    def build():
        model = GPT2LMHeadModel(_config(size))
        holder["model"] = rt.prepare(model, torch.optim.AdamW(model.parameters()))[0]

    _, build_row = _measured(build)
    model = holder["model"]
    info, load_row = _measured(lambda: rt.load_pretrained(model, folder))
    total = {"peak_mb": max(build_row["peak_mb"], load_row["peak_mb"]),
             "seconds": round(build_row["seconds"] + load_row["seconds"], 2)}  # fmt: skip
    _, save_row = _measured(lambda: rt.save_pretrained(model, Path(folder) / "export"))
    return {"build + prepare + load_pretrained": total, "load_pretrained": load_row,
            "save_pretrained": save_row, "read_mb": round(info.read_bytes / 2**20, 1),
            "checkpoint_mb": round(info.total_bytes / 2**20, 1), "shard_mb": _shard_mb(model)}  # fmt: skip


def _meta(folder: str, size: dict) -> dict:
    """Meta build + prepare + load_pretrained (deferred init), measured as one phase."""
    import inspect

    from transformers import GPT2LMHeadModel

    torch.set_num_threads(1)
    _exact_rss()
    _quiet()
    rt = rw.init(strategy="zero3")
    if "init" not in inspect.signature(rt.prepare).parameters:
        return {"skipped": "rt.prepare does not take meta-device models here"}

    def run():
        with torch.device("meta"):
            model = GPT2LMHeadModel(_config(size))
        opt = torch.optim.AdamW(model.parameters())
        model, _ = rt.prepare(model, opt, init=model._init_weights)
        rt.load_pretrained(model, folder)
        return model

    model, row = _measured(run)
    return {"meta build + prepare + load_pretrained": row, "shard_mb": _shard_mb(model)}


def _merge(per_rank: list[dict]) -> dict:
    out = {}
    for key, value in per_rank[0].items():
        if isinstance(value, dict):
            out[key] = {c: max(r[key][c] for r in per_rank) for c in value}
            out[key]["per_rank_peak_mb"] = [r[key]["peak_mb"] for r in per_rank]
        else:
            out[key] = [r[key] for r in per_rank]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a 4M-parameter GPT-2 (smoke run)")
    ap.add_argument("--shard", type=int, default=100, help="MB per checkpoint file")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pretrained.json"))
    ap.add_argument("--note", default="2 shared CPU cores, taken under load")
    args = ap.parse_args()
    size = SMALL if args.small else FULL
    _quiet()
    with tempfile.TemporaryDirectory() as folder:
        from transformers import GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(_config(size))
        params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        model.save_pretrained(folder, max_shard_size=f"{args.shard}MB")
        del model
        gc.collect()
        today = run_distributed(_today, args.world, args=(folder, size), timeout=3000, init=False)
        ours = run_distributed(_ours, args.world, args=(folder, size), timeout=3000, init=False)
        meta = run_distributed(_meta, args.world, args=(folder, size), timeout=3000, init=False)
    doc = {"benchmark": "pretrained", "note": args.note, "world": args.world,
           "strategy": "zero3", "model": "GPT2LMHeadModel", "size": size,
           "params_m": round(params / 1e6, 2), "largest_tensor_mb": round(largest, 1),
           "today": _merge(today), "rankwise": _merge(ours),
           "rankwise_meta": meta[0] if "skipped" in meta[0] else _merge(meta)}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
