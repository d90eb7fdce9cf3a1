"""Tensor parallelism: ours vs torch's ``parallelize_module``, tensor 1/2/4 at world 4 (Gloo).

    flock /tmp/bench.lock python benchmarks/tensor_parallel.py [--quick]

One spawned group of 4 ranks. For each tensor size T in 1, 2, 4 the mesh is data 4/T x tensor
T (tensor innermost, as ``rw.init_mesh`` and torch's ``init_device_mesh`` both lay it out) and
the global batch is the same, so every row is the same computation. In each rank, fresh:

- ``rankwise``: ``rw.tensor_parallel(GPT, GPT_PLAN)`` (fused qkv split by heads, vocabulary-
  parallel embedding, head and cross-entropy), our DDP over the data group (Gloo all-reduce);
- ``torch``: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the same
  model (embedding ``RowwiseParallel(input_layouts=Replicate())``, head ``ColwiseParallel``
  with ``loss_parallel()`` for the cross-entropy; the tie re-made after the split), the
  data-group gradient average done by hand (torch's DDP does not take DTensor parameters).
  Its ``ColwiseParallel`` cuts the fused ``[q; k; v]`` weight into contiguous rows, not heads:
  the same FLOPs and traffic, not the same function (ours is tested against the unsplit model);
- **step ms**: median wall time of forward, backward, ``step``, ``zero_grad``;
- **state MB/rank**: parameters, gradients and AdamW state this rank holds, from the tensors.

The machine is shared (2 cores for 4 ranks, other jobs running): times are noisy; the JSON
says so. Prints one JSON object and writes ``benchmarks/results/tensor_parallel.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

import rankwise as rw
from rankwise.models import GPT, GPT_PLAN, GPTConfig
from rankwise.testing import run_distributed

WORLD = 4
SIZES = {
    "quick": {"cfg": dict(vocab_size=1024, block_size=64, n_layer=2, n_head=8, n_embd=128),
              "batch": 8, "steps": 4},
    "full": {"cfg": dict(vocab_size=8192, block_size=128, n_layer=4, n_head=8, n_embd=512),
             "batch": 8, "steps": 8},
}  # fmt: skip


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def state_mb(model, opt) -> float:
    tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    params = list(model.parameters())
    tensors += params + [p.grad for p in params]
    seen = {}
    for t in (_local(t) for t in tensors if t is not None):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return round(sum(seen.values()) / 2**20, 2)


def _ours(cfg: GPTConfig, tensor: int):
    mesh = rw.init_mesh({"data": WORLD // tensor, "tensor": tensor})
    torch.manual_seed(0)
    model = rw.tensor_parallel(GPT(cfg), GPT_PLAN, group=mesh.group("tensor"))
    # Gloo all-reduce, as torch's side: on one machine our DDP would otherwise average through
    # shared memory, whose mapped file (every rank's slot) shows in the gradients' storage.
    wrapped = rw.DistributedDataParallel(
        model, process_group=mesh.group("data"), shared_memory_reduce=False
    )
    group = mesh.group("tensor")

    def loss(x, y):
        out = rw.vocab_parallel_cross_entropy(wrapped(x)[0], y, group)
        out.backward()
        return out

    return model, loss, mesh.coord("data"), lambda: None


def _torch(cfg: GPTConfig, tensor: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD // tensor, tensor), mesh_dim_names=("data", "tensor"))
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(use_local_output=False)}  # fmt: skip
    for i in range(cfg.n_layer):
        plan |= {f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                 f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()}  # fmt: skip
    parallelize_module(model, mesh["tensor"], plan)
    model.lm_head.weight = model.wte.weight  # both Shard(0): the tie, re-made
    data_group, data_size = mesh["data"].get_group(), WORLD // tensor

    def loss(x, y):
        with loss_parallel():  # the backward too: it sees the sharded logits
            out = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
            out.backward()
        return out

    def average_grads():
        if data_size > 1:
            for p in model.parameters():
                g = _local(p.grad)
                dist.all_reduce(g, group=data_group)
                g /= data_size

    return model, loss, mesh.get_local_rank("data"), average_grads


def _one(impl: str, cfg: GPTConfig, tensor: int, batch: int, steps: int) -> dict:
    model, loss_fn, data_rank, average = (_ours if impl == "rankwise" else _torch)(cfg, tensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    per = batch // (WORLD // tensor)
    x, y = x[data_rank * per : (data_rank + 1) * per], y[data_rank * per : (data_rank + 1) * per]
    times, losses = [], []
    for step in range(steps + 1):  # step 0 warms up
        dist.barrier()
        t0 = time.perf_counter()
        loss = loss_fn(x, y)  # forward and backward
        average()
        opt.step()
        held = state_mb(model, opt)
        opt.zero_grad()
        if step:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(round(float(_local(loss.detach()).item()), 4))
    return {"step_ms": round(statistics.median(times), 1), "state_mb": held, "loss": losses[-1]}


def _rank(size: str, repeats: int) -> dict:
    torch.set_num_threads(1)
    spec = SIZES[size]
    cfg = GPTConfig(**spec["cfg"])
    full = GPT(cfg)
    out = {"params_m": round(sum(p.numel() for p in full.parameters()) / 1e6, 2)}
    for tensor in (1, 2, 4):
        rows: dict[str, list[dict]] = {"rankwise": [], "torch": []}
        for r in range(repeats):
            for impl in ("rankwise", "torch") if r % 2 == 0 else ("torch", "rankwise"):
                rows[impl].append(_one(impl, cfg, tensor, spec["batch"], spec["steps"]))
        for impl, runs in rows.items():
            out[f"tensor{tensor}/{impl}"] = {
                "step_ms": round(statistics.median(r["step_ms"] for r in runs), 1),
                "state_mb": runs[0]["state_mb"],
                "loss": runs[0]["loss"],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small GPT, 4 steps (a smoke run)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats per row")
    ap.add_argument(
        "--note",
        default="2 CPU cores shared by 4 ranks",
        help="what else ran on the machine (kept in the JSON)",
    )
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "tensor_parallel.json")
    )
    args = ap.parse_args()
    size = "quick" if args.quick else "full"
    per_rank = run_distributed(_rank, WORLD, args=(size, args.repeats), timeout=3000)
    rows = {k: v for k, v in per_rank[0].items() if isinstance(v, dict)}
    for key in rows:  # the slowest rank's time, the largest rank's state
        rows[key]["step_ms"] = max(r[key]["step_ms"] for r in per_rank)
        rows[key]["state_mb"] = max(r[key]["state_mb"] for r in per_rank)
    emit({
        "benchmark": "tensor_parallel", "world": WORLD, "size": size,
        "model": SIZES[size], "params_m": per_rank[0]["params_m"],
        "load_note": args.note,
        "rows": rows,
    }, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
