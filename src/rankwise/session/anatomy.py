"""Step anatomy on for what ``rt.prepare`` returns: the hooks that feed ``rankwise.timing``.

The engines time their own waits (the DDP reducer, ZeRO's gathers and reductions, the pipeline
executor); here the session adds what only it sees: the prepared model's forward (a forward
hook) and its backward (from the output's gradient hook to the end of autograd's pass), the
optimizer's step (its step hooks; the end of a step is the end of the optimizer's), and where
the records go: rank 0's trackers (``rt.log``'s, when open) and the end-of-run summary.
Checkpoints (``rt.save``) and the data wait (the prepared loader) are timed where they run.

On by default (``RANKWISE_PROFILE_STEPS``, default a record every 10 steps; 0: off). Not for an
optimizer without torch's step hooks, nor the asynchronous strategy (its ranks step apart).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from .. import runtime, timing
from ..output.log import write
from ..timing import clock
from ..timing.recorder import Recorder

Session = Any
"""``rankwise.session.Session``, which calls these functions: named, not imported (a cycle)."""

SERIES = ("data", "forward", "backward", "comm", "wait", "optimizer", "other", "total")
"""The per-rank series sent to the trackers, in milliseconds (``timing/rank{r}/{name}_ms``)."""


def start(rt: Session, model: nn.Module, optimizer: Any) -> None:
    """Time ``model``'s steps, ended by ``optimizer``'s. Once per session (the first model)."""
    every, folder = timing.settings_from_env()
    target = _stepping(optimizer)
    if every == 0 or target is None or rt.loop.timing is not None or rt.strategy == "async":
        return
    recorder = Recorder(rank=rt.rank, world=rt.world_size, strategy=rt.strategy,
                        device=rt.device, every=every, node=runtime.coords().node,
                        role=_role(rt), run_dir=folder)  # fmt: skip
    rt.loop.timing = recorder
    clock.install(recorder.clock)
    target.register_step_pre_hook(lambda *_: clock.begin("optimizer"))
    target.register_step_post_hook(lambda *_: _step_done(recorder))
    model.register_forward_pre_hook(lambda *_: clock.begin("forward"))
    model.register_forward_hook(_forward_done)
    recorder.listeners.append(lambda step, table, named: _to_trackers(rt, step, table, named))
    runtime.on_shutdown(lambda: _finish(rt), always=True, first=True)


def _stepping(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer whose step hooks fire (the one inside our wrappers), or None."""
    seen = 0
    while optimizer is not None and seen < 4:
        if hasattr(optimizer, "_optimizer_step_post_hooks"):
            return optimizer
        optimizer = getattr(optimizer, "inner", None) or getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def _role(rt: Session) -> int:
    """Ranks with the same role do the same work: a pipeline stage's replicas."""
    mesh = getattr(rt, "mesh", None)
    if mesh is None or "pipeline" not in getattr(mesh, "sizes", {}):
        return 0
    return int(mesh.coord("pipeline"))


def _step_done(recorder: Recorder) -> None:
    clock.end("optimizer")
    recorder.on_step()


def _forward_done(module: nn.Module, args: Any, out: Any) -> None:
    clock.end("forward")
    if not torch.is_grad_enabled():
        return
    ended = time.perf_counter()
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(lambda grad: _backward_begins(ended))
            return


def _backward_begins(forward_ended: float) -> None:
    # From the forward's end: the loss and its backward (a hook on it) are the step's compute.
    clock.begin("backward", any_thread=True, since=forward_ended)
    Variable._execution_engine.queue_callback(lambda: clock.end("backward", any_thread=True))


def _to_trackers(rt: Session, step: int, table: list[dict[str, Any]], named: Any) -> None:
    """Rank 0: each rank's anatomy as series of ``rt.log``'s trackers, when they are open."""
    logger = rt.loop.metrics
    if logger is None:
        return
    values = {f"timing/rank{r['rank']}/{k}_ms": r[k] * 1e3 for r in table for k in SERIES}
    values.update({f"timing/rank{r['rank']}/mem_mib": r["mem"] / 2**20 for r in table
                   if r["mem"] is not None})  # fmt: skip
    values["timing/straggler_rank"] = -1.0 if named is None else float(named.rank)
    logger.log_series(values, step)


def _finish(rt: Session) -> None:
    """At ``rw.shutdown()`` (or exit): the end-of-run summary on rank 0, files closed."""
    recorder, rt.loop.timing = rt.loop.timing, None
    if recorder is None:
        return
    text = recorder.close()
    if text and (recorder.world > 1 or recorder.events):
        write(text)
