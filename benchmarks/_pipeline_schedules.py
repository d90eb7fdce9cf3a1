"""The schedules part of ``benchmarks/pipeline.py``: one spawned group of P ranks (Gloo, CPU).

Each rank builds the same GPT (``sequential_gpt``: embeddings, blocks, head, untied so that
torch's stages can hold it too) and, for each micro-batch count and schedule, two pipelines
over the same stage bounds (balanced by parameter count, ``stages_per_rank`` virtual stages):

- ``rankwise``: ``rw.DistributedPipeline(schedule=...)``;
- ``torch``: ``torch.distributed.pipelining.PipelineStage`` per stage and torch's schedule of
  the same name (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``).

With ``compute="simulated"`` the model is instead a stack of ``SleepLinear`` layers whose
forward, input-gradient and weight-gradient passes each sleep a fixed time per sample (the GIL
released, no CPU used): the schedules' own step time and bubble, without the stages competing
for the cores of a small or shared machine (activation memory is then meaningless). A sleep
ends late by its thread's wake-up latency, which depends on what else runs on the cores, so
each simulated step also reports how long its sleeps overslept (``oversleep_ms_per_stage``):
time that is neither the schedule's nor its transport's, but counts in its step.

Steps alternate between the two (a barrier before each), so load on a shared machine hits
both alike. Per rank and step: the wall time; the compute time (ours: the executor's
actions; torch's: its stage's forward/backward calls, timed by wrapping them); the bubble
``1 - compute / step`` (idle time, mostly waiting for the neighbours); and the peak of
activation memory: bytes of the tensors autograd saves for backward alive at once
(``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, parameters not),
from one more step under those hooks, after the timed ones, which run without them.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _paired import paired_ratio
from torch import nn
from torch.distributed import pipelining as tpp

import rankwise as rw
from rankwise.models.gpt import GPTConfig, sequential_gpt
from rankwise.pipeline.partition import balance_by_params
from rankwise.pipeline.schedules import Action, make
from rankwise.pipeline.simulate import simulate

SCHEDULES = (
    ("gpipe", 1, "ScheduleGPipe"),
    ("1f1b", 1, "Schedule1F1B"),
    ("interleaved_1f1b", 2, "ScheduleInterleaved1F1B"),
    ("zero_bubble", 1, "ScheduleInterleavedZeroBubble"),
    ("zero_bubble", 2, "ScheduleInterleavedZeroBubble"),
)
"""(our schedule, virtual stages per rank, torch's class of the same schedule)."""

SIM_LAYERS = 16
"""Layers of the simulated stack: as many per stage at 2, 4 or 8 stages."""


class SavedBytes:
    """Peak bytes of the tensors autograd saves for backward (each storage once)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.refs, self.live, self.peak = exclude, defaultdict(int), 0, 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.exclude or t.untyped_storage().nbytes() == 0:
            return _Held(t, None, None)
        if self.refs[key] == 0:
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return _Held(t, self, key)

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= nbytes


class _Held:
    def __init__(self, tensor: torch.Tensor, tracker: SavedBytes | None, key: int | None) -> None:
        self.tensor, self.tracker, self.key = tensor, tracker, key
        self.nbytes = tensor.untyped_storage().nbytes()

    def __del__(self) -> None:
        if self.tracker is not None:
            self.tracker.release(self.key, self.nbytes)


class _Sleep(torch.autograd.Function):
    """``x @ w`` that takes ``per_sample`` seconds per sample forward, and as long again for
    each gradient asked for (input, weight): a stand-in for a device's compute."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, per_sample: float) -> torch.Tensor:
        ctx.per_sample, ctx.n = per_sample, x.shape[0]
        ctx.save_for_backward(x, w)
        _sleep(per_sample * x.shape[0])
        return x @ w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = time.perf_counter()
        x, w = ctx.saved_tensors
        need_x, need_w = _needed(ctx, 0), _needed(ctx, 1)
        # asking the engine is the stand-in's own cost (no real layer pays it, and it differs
        # with how the caller ran backward): it counts within the layer's time, not on top
        asked = time.perf_counter() - start
        _sleep(max(0.0, ctx.per_sample * ctx.n * (int(need_x) + int(need_w)) - asked))
        return (grad @ w.t() if need_x else None), (x.t() @ grad if need_w else None), None


OVERSLEPT = [0.0]
"""Seconds the stand-in's sleeps took beyond what they asked for, in this process, since the
last reset (``_timed_step`` resets it): the wake-up latency a sleeping layer pays and a
computing one does not. Reported beside each simulated step (``oversleep_ms``)."""


def _sleep(seconds: float) -> None:
    if seconds <= 0:
        return
    start = time.perf_counter()
    time.sleep(seconds)
    OVERSLEPT[0] += max(0.0, time.perf_counter() - start - seconds)


_WEIGHTS_ASKED: dict[str, Any] = {"task": -1, "answer": None}
"""The running graph task and the engine's answer for the first weight asked in it."""


def _needed(ctx, k: int) -> bool:
    """Whether this backward pass wants input ``k``'s gradient (an input-only or weight-only
    pass asks for one: what a real layer's kernels skip, the stand-in skips sleeping).

    The weights' answer is asked once per pass and reused for every layer: every pass either
    wants all the weights of the stage (a whole backward, or a weight pass) or none (an input
    pass). The nodes asked about are views' (``SleepLinear.forward``): asked about a leaf
    that ``autograd.grad`` captures, the engine raises (the fallback ``needs_input_grad`` then
    answers), a cost no real layer pays, which ours paid on every backward (``autograd.grad``
    of the input and the weights) and torch's 1F1B (``autograd.backward``) never did."""
    node = ctx.next_functions[k][0]
    if node is None:
        return False
    if k == 1:
        task = torch._C._current_graph_task_id()
        if _WEIGHTS_ASKED["task"] != task:
            _WEIGHTS_ASKED.update(task=task, answer=_ask(ctx, node, k))
        return _WEIGHTS_ASKED["answer"]
    return _ask(ctx, node, k)


def _ask(ctx, node, k: int) -> bool:
    try:  # torch's own test of the running graph task (used by its checkpointing)
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):
        return ctx.needs_input_grad[k]


class SleepLinear(nn.Linear):
    """A square linear layer computed by ``_Sleep`` (an ``nn.Linear``: the split backward
    cuts it, so its weight pass sleeps apart)."""

    def __init__(self, width: int, per_sample: float) -> None:
        super().__init__(width, width, bias=False)
        self.per_sample = per_sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Leaves reach _Sleep through a view, so that its backward asks the engine about a
        # view's node, never a leaf's: about a captured leaf (``autograd.grad`` of a stage's
        # input and weights) the engine raises, which costs about 50 us of CPU a time, a cost
        # of the stand-in that taking it out of the sleep hides on its own rank only (the
        # other rank's wake-ups find the core busy).
        if x.grad_fn is None and x.requires_grad:
            x = x.view_as(x)
        return _Sleep.apply(x, self.weight.view_as(self.weight), self.per_sample)


def _model(cfg: GPTConfig, compute: str, per_sample: float) -> nn.Sequential:
    torch.manual_seed(0)
    if compute == "simulated":
        return nn.Sequential(*[SleepLinear(8, per_sample) for _ in range(SIM_LAYERS)])
    return sequential_gpt(cfg)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.dim() == 2:  # the simulated stack
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _bounds(model: nn.Sequential, stages: int) -> list[int]:
    bounds = [0]
    for size in balance_by_params(model, stages):
        bounds.append(bounds[-1] + size)
    return bounds


def _ours(model: nn.Sequential, name: str, v: int, m: int, durations: dict | None = None):
    """Our pipeline and its step; ``durations`` (if given) collects each action's time, in
    seconds, step after step: ``(kind, stage, micro_batch) -> [s, ...]``."""
    stages = dist.get_world_size() * v
    balance = [b - a for a, b in zip(_bounds(model, stages), _bounds(model, stages)[1:], strict=False)]
    pipe = rw.DistributedPipeline(model, balance=balance, chunks=m, schedule=name, stages_per_rank=v)

    def step(x, y) -> float:
        pipe.train_step(x, y, _loss)
        pipe.zero_grad(set_to_none=True)
        events = pipe.last_step.events
        for e in events if durations is not None else ():
            a = e.action
            durations.setdefault((a.kind, a.stage, a.micro_batch), []).append(e.end - e.start)
        return sum(e.end - e.start for e in events)

    return pipe, step


def _torch(model: nn.Sequential, cls_name: str, v: int, m: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    num = world * v
    bounds, layers = _bounds(model, num), list(model.children())
    stages = [tpp.PipelineStage(nn.Sequential(*layers[bounds[s] : bounds[s + 1]]), s, num,
                                torch.device("cpu")) for s in range(rank, num, world)]  # fmt: skip
    busy = [0.0]
    for stage in stages:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            _timed(stage, method, busy)
    cls = getattr(tpp, cls_name)
    multi = cls_name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
    schedule = cls(stages if multi else stages[0], n_microbatches=m, loss_fn=_loss)
    holder = nn.ModuleList([s.submod for s in stages])

    def step(x, y) -> float:
        busy[0] = 0.0
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        holder.zero_grad(set_to_none=True)
        return busy[0]

    return holder, step


def _timed(stage: Any, method: str, busy: list[float]) -> None:
    inner = getattr(stage, method, None)
    if inner is None:
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    setattr(stage, method, wrapped)


def _timed_step(step, x, y) -> dict[str, float]:
    """One plain step: its time, (busy compute) its bubble, and how long the simulated layers
    overslept in it (0 for real compute)."""
    dist.barrier()
    OVERSLEPT[0] = 0.0
    start = time.perf_counter()
    busy = step(x, y)
    t = time.perf_counter() - start
    return {"step_ms": 1000 * t, "bubble": max(0.0, 1 - busy / t), "oversleep_ms": 1000 * OVERSLEPT[0]}


def _one_way_s(shape: tuple[int, ...], trips: int = 20) -> float:
    """One message of ``shape`` (float32) from rank 0 to rank 1: half the median round trip
    over ``trips`` ping-pongs on the pipeline's engine (rank 0's figure; the others wait)."""
    rank, buf, times = dist.get_rank(), torch.zeros(shape), []
    dist.barrier()
    for _ in range(trips if rank < 2 else 0):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1), dist.recv(buf, 1)
        else:
            dist.recv(buf, 0), dist.send(buf, 0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2 if times else 0.0


def _activation_peak_mb(module: nn.Module, step, x, y) -> float:
    """The activation peak of one more step, under the counting hooks. No timed step runs
    under them: they run Python for every tensor autograd saves, which slowed our zero-bubble
    steps more than torch's."""
    saved = SavedBytes({p.untyped_storage().data_ptr() for p in module.parameters()})
    dist.barrier()
    with saved.hooks():
        step(x, y)
    return saved.peak / 2**20


def _per_sample_shape(cfg: GPTConfig, compute: str) -> tuple[int, ...]:
    """What crosses between stages per sample: the hidden state (GPT), or the stack's width."""
    return (8,) if compute == "simulated" else (cfg.block_size, cfg.n_embd)


def _batch(cfg: GPTConfig, compute: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if compute == "simulated":
        return torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)


def bench_rank(
    cfg_kwargs: dict, batch: int, micro: list[int], repeats: int, compute: str = "gpt",
    stage_ms: float = 40.0,
) -> list[dict]:  # fmt: skip
    """This rank's figures for every (m, schedule): ours and torch's, alternating.
    ``stage_ms`` (simulated): one pipeline stage's forward of the whole batch."""
    torch.set_num_threads(1)
    cfg = GPTConfig(**cfg_kwargs)
    x, y = _batch(cfg, compute, batch)
    layers_per_stage = SIM_LAYERS / dist.get_world_size()
    per_sample = stage_ms / 1000 / batch / layers_per_stage
    rows = []
    for m in micro:
        for name, v, torch_name in SCHEDULES:
            if dist.get_world_size() * v > (SIM_LAYERS if compute == "simulated" else cfg.n_layer + 2):
                continue
            durations: dict = {}
            ours, ours_step = _ours(_model(cfg, compute, per_sample), name, v, m, durations)
            theirs, their_step = _torch(_model(cfg, compute, per_sample), torch_name, v, m)
            ours_step(x, y), their_step(x, y)  # warm-up (torch infers its shapes here)
            durations.clear()
            per = {"rankwise": [], "torch": []}
            for _ in range(repeats):  # alternate, one step each, so load hits both alike
                per["rankwise"].append(_timed_step(ours_step, x, y))
                per["torch"].append(_timed_step(their_step, x, y))
            row = {"m": m, "schedule": name, "stages_per_rank": v, "torch_schedule": torch_name}
            for who, runs in per.items():
                row[who] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                row[who]["steps_ms"] = [r["step_ms"] for r in runs]
            row["action_s"] = [(*a, statistics.median(d)) for a, d in durations.items()]
            row["one_way_s"] = _one_way_s((x.shape[0] // m, *_per_sample_shape(cfg, compute)))
            row["rankwise"]["activation_peak_mb"] = _activation_peak_mb(ours, ours_step, x, y)
            row["torch"]["activation_peak_mb"] = _activation_peak_mb(theirs, their_step, x, y)
            row["rankwise"]["recv_wait_ms"] = 1000 * ours.last_step.recv_wait_s
            rows.append(row)
    return rows


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (m, schedule): the step time of the slowest rank, bubble and peak
    activation memory per stage (rank)."""
    out = []
    for rows in zip(*per_rank, strict=True):
        row = {k: rows[0][k] for k in ("m", "schedule", "stages_per_rank", "torch_schedule")}
        for who in ("rankwise", "torch"):
            row[who] = {
                "step_ms": max(r[who]["step_ms"] for r in rows),
                "bubble_per_stage": [round(r[who]["bubble"], 3) for r in rows],
                "activation_peak_mb_per_stage": [
                    round(r[who]["activation_peak_mb"], 2) for r in rows
                ],
                "oversleep_ms_per_stage": [round(r[who]["oversleep_ms"], 2) for r in rows],
            }
        waits = [round(r["rankwise"]["recv_wait_ms"], 1) for r in rows]
        row["rankwise"]["recv_wait_ms_per_stage"] = waits
        row["step_ours_over_torch"] = row["rankwise"]["step_ms"] / row["torch"]["step_ms"]
        row.update(_spread_and_ceiling(rows))
        out.append(row)
    return out


def _spread_and_ceiling(rows: tuple[dict, ...]) -> dict:
    """The ratio repeat by repeat (each repeat's slowest rank, ours over torch's: the noise
    around the median), and the ceiling: our schedule played on paper with each action's
    median measured time and free communication (``rankwise.pipeline.simulate``), the step no
    implementation of this schedule over these stages can beat by more than its own actions'
    speed. Printed beside both steps. ``ratio_paired``: whether ours is slower than torch's
    beyond the repeats' spread (``_paired``)."""
    per_repeat = {who: [max(s) for s in zip(*(r[who]["steps_ms"] for r in rows), strict=True)]
                  for who in ("rankwise", "torch")}  # fmt: skip
    ratios = sorted(a / b for a, b in zip(per_repeat["rankwise"], per_repeat["torch"], strict=True))
    cost = {Action(k, s, i): d for r in rows for k, s, i, d in r["action_s"]}
    first = rows[0]
    schedule = make(first["schedule"], len(rows), first["m"], first["stages_per_rank"])
    ceiling_ms = 1000 * simulate(schedule, cost.__getitem__).makespan
    one_way = rows[0]["one_way_s"]
    link_ms = 1000 * simulate(schedule, cost.__getitem__, latency=one_way).makespan
    spread = {"min": ratios[0], "median": statistics.median(ratios), "max": ratios[-1],
              "n": len(ratios)}  # fmt: skip
    return {
        "ratio_per_repeat": spread,
        "ratio_paired": paired_ratio(per_repeat["rankwise"], per_repeat["torch"]),
        "steps_ms_per_repeat": per_repeat,  # each repeat's slowest stage, for later analysis
        "ceiling_ms": ceiling_ms,
        "rankwise_over_ceiling": max(r["rankwise"]["step_ms"] for r in rows) / ceiling_ms,
        "torch_over_ceiling": max(r["torch"]["step_ms"] for r in rows) / ceiling_ms,
        "one_way_ms": 1000 * one_way,
        "link_ceiling_ms": link_ms,
        "rankwise_over_link_ceiling": max(r["rankwise"]["step_ms"] for r in rows) / link_ms,
        "torch_over_link_ceiling": max(r["torch"]["step_ms"] for r in rows) / link_ms,
    }
