"""Step-time overhead of collective fingerprints, on the reference models, 2 ranks on gloo.

The gradient sync is what the DDP reducer does: post-accumulate-grad hooks fill flat bucket
buffers (parameters in reverse order, a size cap) and each full bucket is all-reduced with
``async_op=True``; the step waits for every bucket and copies the mean back into ``.grad``.
Modes, interleaved in blocks of steps (so drift on this shared machine hits them alike):

- ``off``: fingerprints disabled (``configure(enabled=False)``), the baseline;
- ``on``: the defaults (record + publish every bucket, check every 256th);
- ``strict``: ``check_every=1``, every bucket checked across ranks before it is issued;
- ``torch_detail``: fingerprints off, the buckets go through a process group created under
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's own collective fingerprinting), for comparison.

Also measured alone: the cost of one ``record`` + ``done`` call, and of one check.
Run: ``flock /tmp/rankwise-bench.lock python benchmarks/diagnostics.py [--out file.json]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _report import emit
from torch import nn

MODES = ("off", "on", "strict", "torch_detail")


def mlp() -> nn.Module:
    """~10.5M parameters."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10),
    )  # fmt: skip


def cnn() -> nn.Module:
    """A small CNN for 3x32x32 images (~0.6M parameters)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 16, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip


class BucketSync:
    """The DDP reducer's gradient sync in miniature: hooks, flat buckets, async all-reduce."""

    def __init__(self, model: nn.Module, cap_bytes: int) -> None:
        from rankwise.diagnose import fingerprints as fp

        self.fp, self.group = fp, None
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            if size and size + p.numel() * p.element_size() > cap_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.flat = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.where = {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._ready)
        self.pending = [0] * len(self.buckets)
        self.entries: list = []

    def _ready(self, p: torch.Tensor) -> None:
        i, offset = self.where[p]
        self.flat[i][offset : offset + p.numel()].copy_(p.grad.view(-1))
        self.pending[i] += 1
        if self.pending[i] == len(self.buckets[i]):
            entry = self.fp.record("all_reduce", self.flat[i], label=f"bucket {i}", extra="sum")
            entry.watch(dist.all_reduce(self.flat[i], async_op=True, group=self.group))
            self.entries.append(entry)

    def finish(self) -> None:
        world = dist.get_world_size()
        for entry in self.entries:
            entry.wait()
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                p.grad.view(-1).copy_(self.flat[i][offset : offset + p.numel()]).div_(world)
                offset += p.numel()
        self.entries, self.pending = [], [0] * len(self.buckets)


def _set_mode(sync: BucketSync, mode: str, detail_group) -> None:
    fp = sync.fp
    fp.configure(enabled=mode in ("on", "strict"), check_every=1 if mode == "strict" else 256)
    sync.group = detail_group if mode == "torch_detail" else None


def _time_model(name: str, make, batch: torch.Tensor, args, detail_group) -> dict:
    torch.manual_seed(0)
    model = make()
    sync = BucketSync(model, args.bucket_mb << 20)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    target = torch.zeros(batch.shape[0], dtype=torch.long)
    for rep in range(args.reps + 1):  # rep 0 warms up every mode (and the first 32 checks)
        order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
        for mode in order:
            _set_mode(sync, mode, detail_group)
            for _ in range(args.block):
                t0 = time.perf_counter()
                loss = nn.functional.cross_entropy(model(batch), target)
                loss.backward()
                sync.finish()
                opt.step()
                opt.zero_grad(set_to_none=False)
                if rep:
                    times[mode].append(time.perf_counter() - t0)
    base = statistics.median(times["off"])
    # Paired: each block's mean against the "off" block of the same round (drift cancels).
    paired = {m: [] for m in MODES}
    for i in range(0, len(times["off"]), args.block):
        off = statistics.fmean(times["off"][i : i + args.block])
        for m in MODES:
            paired[m].append(statistics.fmean(times[m][i : i + args.block]) / off - 1)
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "buckets": len(sync.buckets),
        "steps_per_mode": len(times["off"]),
        "median_step_ms": {m: round(statistics.median(t) * 1e3, 3) for m, t in times.items()},
        "overhead_pct_vs_off_paired_median": {
            m: round(statistics.median(v) * 100, 2) for m, v in paired.items()
        },
        "noise_pct_iqr_off_vs_off": _iqr_pct(times["off"]),
        "overhead_pct_from_record_cost": round(
            len(sync.buckets) * args.record_us / (base * 1e6) * 100, 3
        ),
    }


def _iqr_pct(values: list[float]) -> float:
    """Spread of the baseline itself: (q3 - q1) / median, in percent."""
    q = statistics.quantiles(values, n=4)
    return round((q[2] - q[0]) / statistics.median(values) * 100, 1)


def _micro(n: int) -> dict:
    from rankwise.diagnose import fingerprints as fp

    fp.configure(enabled=True, check_every=0)
    t = torch.zeros(1024)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fp.record("all_reduce", t, label="bucket 0", extra="sum", check=False).done()
    record_us = (time.perf_counter() - t0) / n * 1e6
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        fp.verify()
    check_us = (time.perf_counter() - t0) / 200 * 1e6
    return {"record_and_done_us": round(record_us, 2), "check_us": round(check_us, 1)}


def _rank_main(args) -> dict:
    torch.set_num_threads(1)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    detail_group = dist.new_group(backend="gloo")  # torch wraps it: fingerprint checks per call
    dist.set_debug_level(dist.DebugLevel.OFF)
    out = {"micro": _micro(args.micro_calls)}
    args.record_us = out["micro"]["record_and_done_us"]
    out["models"] = [
        _time_model("mlp_10M", mlp, torch.randn(args.batch, 1024), args, detail_group),
        _time_model("cnn_small", cnn, torch.randn(args.batch, 3, 32, 32), args, detail_group),
    ]
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="interleaved rounds")
    parser.add_argument("--block", type=int, default=1, help="steps per mode per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-mb", type=int, default=4, help="bucket cap (torch DDP: 25)")
    parser.add_argument("--micro-calls", type=int, default=5000)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    from rankwise.testing import run_distributed

    t0 = time.time()
    per_rank = run_distributed(_rank_main, 2, args=(args,), timeout=600)
    result = {
        "benchmark": "diagnostics",
        "world_size": 2,
        "backend": "gloo",
        "torch": torch.__version__,
        "settings": vars(args),
        "rank0": per_rank[0],
        "rank1_micro": per_rank[1]["micro"],
        "wall_s": round(time.time() - t0, 1),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
