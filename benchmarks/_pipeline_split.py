"""The ``split`` part of ``benchmarks/pipeline.py``: ``rw.split``'s GPipe bubble in one process.

Two set-ups, each against the unsplit ``nn.Sequential`` (torch's own forward) in the same run,
with repeats interleaved (unsplit, m=1, m=2, ... then again) so that load on the shared machine
hits every variant alike:

- ``compute``: p stages of a few Linear+ReLU layers each, one intra-op thread per stage
  (torch ops release the GIL, so the stage threads compute on separate cores). Only meaningful
  with at least p free cores.
- ``simulated``: p stages whose layer sleeps for a fixed time per sample, like a thread that
  waits on an accelerator: shows the schedule's own overhead and bubble without CPU contention.

For each chunk count m it reports the median time per batch (forward, and forward+backward for
``compute``), the bubble measured from the recorded schedule (1 - busy / (p x span)), the
GPipe bubble (p-1)/(m+p-1), and the ideal time unsplit x (m+p-1)/(m p).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from torch import nn

import rankwise as rw
from rankwise.pipeline import bubble_fraction, measured_bubble


class Sleep(nn.Module):
    """A stand-in for device compute: sleeps ``per_sample`` seconds per sample (GIL released)."""

    def __init__(self, per_sample: float) -> None:
        super().__init__()
        self.per_sample = per_sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.per_sample * x.shape[0])
        return x


def compute_model(stages: int, layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = []
    for _ in range(stages * layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def parallel_efficiency(width: int, repeats: int = 10) -> float:
    """Two threads of matmuls vs one: 2.0 means two cores' worth of compute for two stages.

    Below ~1.5 this machine cannot run two CPU stages side by side at full speed, and no
    schedule can make a CPU-compute pipeline faster than the unsplit model here.
    """
    a = torch.randn(width, width)

    def work() -> None:
        for _ in range(repeats):
            a @ a

    alone = min(_time(work, 3))
    threads = [threading.Thread(target=work) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 2 * alone / (time.perf_counter() - start)


def run_setup(name, model, stages, chunk_list, batch, repeats, rounds, backward):
    """Interleaved timings of the unsplit model and of the split one at each chunk count."""
    x = torch.randn(batch, model[0].in_features if hasattr(model[0], "in_features") else 1)
    balance = [len(model) // stages] * stages
    pipes = {m: rw.split(model, ["cpu"] * stages, balance, chunks=m) for m in chunk_list}

    def step(module):
        def go():
            y = module(x)
            if backward:
                y.sum().backward()

        return go

    # The split modules share the layers with `model`, so all variants compute the same thing.
    times = {"unsplit": [], **{m: [] for m in chunk_list}}
    bubbles = {m: [] for m in chunk_list}
    busy = {m: [] for m in chunk_list}
    step(model)()  # warm-up
    for _ in range(rounds):
        times["unsplit"] += _time(step(model), repeats)
        for m, pipe in pipes.items():
            times[m] += _time(step(pipe), repeats)
            bubbles[m].append(measured_bubble(pipe.last_schedule))
            busy[m].append(sum(e.end - e.start for e in pipe.last_schedule))
    base = statistics.median(times["unsplit"])
    rows = []
    for m in chunk_list:
        t = statistics.median(times[m])
        rows.append({
            "chunks": m,
            "time_per_batch_s": t,
            "speedup_vs_unsplit": base / t,
            "measured_forward_bubble": statistics.median(bubbles[m]),
            # > 1 (forward-only runs): the stages computed slower side by side than alone
            # (CPU contention, smaller matmuls), a cost the bubble formula does not include.
            "stage_busy_s": statistics.median(busy[m]),
            "gpipe_bubble": bubble_fraction(m, stages),
            "ideal_time_s": base * (m + stages - 1) / (m * stages),
        })  # fmt: skip
    return {"setup": name, "stages": stages, "batch": batch, "backward": backward,
            "unsplit_time_per_batch_s": base, "rows": rows}  # fmt: skip
