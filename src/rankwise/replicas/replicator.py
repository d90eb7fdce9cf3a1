"""``Replicas``: every ``every`` steps, this rank's state into its host's RAM folder and into its
buddy's, in a background thread; at start, the newest whole step found among the survivors'
folders, moved over collectives, loaded at whatever world the job now has.

What restarts: torch's elastic agent restarts every worker process of the job when membership
changes (a host lost or joining), so worker memory is gone; the replicas live in tmpfs
(``store.py``), which outlives the workers on the hosts that survive. ``restore`` is what the
restarted workers call first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import validate
from ..checkpoint.api import capture_state
from ..checkpoint.single import apply_payload
from ..comm import collectives as comm
from ..comm import wire
from ..errors import ConfigError, DistributedError
from ..output.log import print0
from . import blob, exchange, interval, plan, shards, store

DEFAULT_EVERY = "auto"
"""The interval chosen from the measured cost of a copy and of a step (``interval.py``)."""


@dataclass(frozen=True)
class ResizeEvent:
    """What ``on_resize`` hooks receive, on every rank, after a restore at another world."""

    step: int
    old_world: int
    new_world: int
    old_accumulation: int
    accumulation: int
    lost_hosts: tuple[str, ...]
    joined_hosts: tuple[str, ...]
    seconds_lost: float


def _limit(model: nn.Module, world: int) -> int:
    """The most bytes a peer's replica may announce: far above the real size (parameters,
    buffers and an optimizer's two moments, however sharded), far below a lie's."""
    local = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return 8 * max(world, 1) * local + (64 << 20)


class Replicas:
    """In-memory replicas of one rank's training state (``rt.replicas(...)`` builds one).

    ``step(n)`` after each optimizer step copies the state every ``every`` steps; ``restore()``
    at start resumes from the newest whole replica, at any world size; ``accumulation`` is the
    micro-batches per step that keep ``global_batch``; ``on_resize(fn)`` registers a hook.
    Sync point: construction, ``step`` on replicating steps and ``restore`` (all ranks).
    """

    def __init__(self, *, model: nn.Module, optimizer: Any = None, scheduler: Any = None,
                 loader: Any = None, every: int | str = DEFAULT_EVERY,
                 global_batch: int | None = None,
                 folder: str | Path | None = None, local_world: int = 1,
                 extra: Callable[[], dict[str, Any]] | None = None,
                 after_restore: Callable[[dict[str, Any]], Any] | None = None) -> None:  # fmt: skip
        validate.module("model", model, where="rt.replicas()")
        if every != "auto" and not (validate.is_int(every) and every >= 1):
            validate.fail("every", every, "'auto' or an int >= 1", where="rt.replicas()",
                          fix="pass every='auto' (from the measured cost) or e.g. every=10.")
        validate.integer("global_batch", global_batch, minimum=1, optional=True,
                         where="rt.replicas()")  # fmt: skip
        self.objects = dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
        self.sharded = shards.applies(model)
        """Under ZeRO a replica holds this rank's shards, not the consolidated state."""
        self.every: int | None = None if every == "auto" else every
        self.global_batch, self.extra = global_batch, extra
        self._timing: dict[str, float] = {}
        self.after_restore = after_restore
        self.rank, self.world = comm.rank(), comm.world_size()
        self.local_world = max(1, min(local_world, self.world))
        self.folder = Path(folder) if folder is not None else store.default_folder()
        self.group = exchange.make_group() if self.world > 1 else None
        host = store.host_name()
        self.hosts = wire.all_gather_json(host, label="replicas: host names",
                                          group=self.group) if self.group else [host]  # fmt: skip
        self.limit = _limit(model, self.world)
        self.accumulation = self._accumulation()
        self.last_replicated: int | None = None
        self.state_bytes = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._hooks: list[Callable[[ResizeEvent], Any]] = []

    def _accumulation(self) -> int:
        if self.global_batch is None:
            return 1
        micro = getattr(self.objects["loader"], "batch_size", None)
        if not isinstance(micro, int) or micro < 1:
            validate.fail("loader", self.objects["loader"], "a loader with a batch_size",
                          where="rt.replicas(global_batch=...)",
                          fix="pass the prepared loader, whose batch_size is the per-rank "
                          "micro-batch.")  # fmt: skip
        return plan.accumulation_for(self.global_batch, self.world, micro)

    def on_resize(self, fn: Callable[[ResizeEvent], Any]) -> Callable[[ResizeEvent], Any]:
        """Call ``fn(event)`` on every rank after a restore at another world (re-plan the
        learning rate, logging, ...). Returns ``fn`` (usable as a decorator)."""
        if not callable(fn):
            validate.fail("fn", fn, "a callable", where="replicas.on_resize()",
                          fix="pass a function taking the ResizeEvent.")  # fmt: skip
        self._hooks.append(fn)
        return fn

    def step(self, step: int, *, epoch: int | None = None) -> bool:
        """After optimizer step ``step``: every ``every`` steps, snapshot the state (one copy,
        now) and hand it to the background thread. True when this step was replicated."""
        if self.every is None:
            return self._calibrate(step, epoch)
        if step % self.every:
            return False
        self._replicate(step, epoch)
        return True

    def _replicate(self, step: int, epoch: int | None) -> None:
        self.wait()
        buf = self.capture(step, epoch)
        self._thread = threading.Thread(target=self._spread, args=(buf, step),
                                        name="rankwise-replicas", daemon=True)  # fmt: skip
        self._thread.start()

    def _calibrate(self, step: int, epoch: int | None) -> bool:
        """``every="auto"``: the first call copies and times it; the second times the step in
        between, agrees with the other ranks on the interval and goes on with it."""
        now = time.perf_counter()
        if "end" not in self._timing:
            self._replicate(step, epoch)
            self._timing.update(capture=time.perf_counter() - now, end=time.perf_counter())
            return True
        step_s = now - self._timing["end"]
        self.wait()
        figures = torch.tensor([self._timing["capture"] + self._timing.get("spread", 0.0), -step_s])
        if self.group is not None:
            torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX,
                                         group=self.group)  # fmt: skip
        cost, step_s = float(figures[0]), -float(figures[1])
        self.every = interval.interval(cost, step_s)
        print0(f"rankwise: replicas every {self.every} step(s): a copy costs {1000 * cost:.0f} "
               f"ms, a step {1000 * step_s:.0f} ms (copies within {interval.BUDGET:.0%} of the "
               "time)")  # fmt: skip
        return self.step(step, epoch=epoch)

    def capture(self, step: int, epoch: int | None) -> torch.Tensor:
        """This rank's state at ``step`` as one buffer (``blob``)."""
        extra = self.extra() if self.extra else None
        info = {"rank": self.rank, "step": step, "epoch": epoch, "world": self.world,
                "time": time.time(), "hosts": self.hosts,
                "accumulation": self.accumulation}  # fmt: skip
        if self.sharded:
            payload, layout = shards.capture(self.objects, extra or {}, self.rank, self.world)
            info.update(layout)
        else:
            payload = capture_state(**self.objects, step=step, epoch=epoch, extra=extra)
        buf = blob.encode(payload, info)
        self.state_bytes = buf.numel()
        return buf

    def _spread(self, buf: torch.Tensor, step: int) -> None:
        """The background half: own folder, then the buddy's copy, then older steps pruned."""
        start = time.perf_counter()
        try:
            store.write(self.folder, plan.Held(self.rank, step, self.world), buf)
            if self.group is not None:
                dst = plan.buddy_of(self.rank, self.world, self.local_world)
                src = plan.buddy_source(self.rank, self.world, self.local_world)
                got = exchange.swap(buf, dst, src, self.group, self.limit)
                store.write(self.folder, plan.Held(src, step, self.world), got)
            if self.last_replicated is not None:
                store.prune(self.folder, self.last_replicated)  # this step and the one before
            self.last_replicated = step
            self._timing["spread"] = time.perf_counter() - start
        except BaseException as exc:  # re-raised on the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Wait for the copy in flight; raise its error on this (the training) thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise DistributedError(
                f"replicas: copying the state failed: {error}",
                fix="see the error above; training can go on without replicas (disk checkpoints).",
                rank=self.rank,
            ) from error

    def close(self, *, remove: bool = False) -> None:
        """Wait for the copy in flight; ``remove=True`` (at the end of the job, on every rank)
        deletes this host's folder. Sync point with ``remove``: all ranks."""
        self.wait()
        if remove:
            if self.group is not None:
                torch.distributed.barrier(group=self.group)
            store.remove(self.folder)

    # -- restore ------------------------------------------------------------------------------

    def restore(self) -> dict[str, Any] | None:
        """Resume from the newest step whose every rank's state survives on some host; None
        when there is none (a fresh job). Returns ``rt.load``'s dict plus ``accumulation``
        and ``resized`` (the ``ResizeEvent``, or None at the same world). Reads only this
        host's folder; the rest comes over collectives. Sync point: all ranks."""
        self.wait()
        started = time.time()
        mine = store.listing(self.folder)
        held = exchange.inventories(mine, self.group) if self.group is not None else [mine]
        chosen = plan.choose(held)
        if chosen is None:
            return None
        step, old_world = chosen
        if self.sharded:
            result, info = shards.restore(self.objects, held, step, old_world, self._read,
                                          self.group, self.limit)  # fmt: skip
            return self._restored(result, info, step, old_world, started)
        if self.group is not None:
            buf, take_rng = exchange.move(held, step, old_world, self._read, self.group,
                                          self.limit)  # fmt: skip
        else:
            buf, take_rng = self._read(plan.Held(0, step, old_world)), True
        state, info = blob.decode(buf)
        if info.get("layout") == shards.LAYOUT:
            raise ConfigError(
                f"replicas: the replicas of step {step} hold ZeRO shards, and this job's model "
                "is not prepared under ZeRO",
                fix="resume with the strategy that wrote them (zero1-3), or from a disk "
                "checkpoint (rt.load loads any strategy's).",
            )
        result = apply_payload(state, self.folder, **self.objects, strict=True,
                               rng_of=0 if take_rng else None)  # fmt: skip
        return self._restored(result, info, step, old_world, started)

    def _restored(self, result: dict[str, Any], info: dict[str, Any], step: int,
                  old_world: int, started: float) -> dict[str, Any]:  # fmt: skip
        if self.after_restore is not None:
            self.after_restore(result)
        self.last_replicated = step
        event = self._event(info, step, old_world, started)
        result.update(accumulation=self.accumulation, resized=event, source="replicas")
        if event is not None:
            for fn in self._hooks:
                fn(event)
        return result

    def _read(self, held: plan.Held) -> torch.Tensor:
        return store.read(self.folder, held)

    def _event(self, info: dict[str, Any], step: int, old_world: int,
               started: float) -> ResizeEvent | None:  # fmt: skip
        """The resize this restore made (None at the same world), told on rank 0."""
        if old_world == self.world:
            return None
        hosts = info.get("hosts")
        old_hosts = [str(h) for h in hosts] if isinstance(hosts, list) else []
        taken = info.get("time")
        event = ResizeEvent(
            step=step, old_world=old_world, new_world=self.world,
            old_accumulation=int(info.get("accumulation", 1)), accumulation=self.accumulation,
            lost_hosts=tuple(sorted(set(old_hosts) - set(self.hosts))),
            joined_hosts=tuple(sorted(set(self.hosts) - set(old_hosts))),
            seconds_lost=time.time() - (taken if isinstance(taken, (int, float)) else started),
        )  # fmt: skip
        print0(describe(event, self.global_batch), ranks_agree=False)  # each rank its own clock
        return event


def describe(event: ResizeEvent, global_batch: int | None) -> str:
    """The one line rank 0 prints per shrink or grow."""
    kind = "shrank" if event.new_world < event.old_world else "grew"
    hosts = []
    if event.lost_hosts:
        hosts.append("lost host " + ", ".join(event.lost_hosts))
    if event.joined_hosts:
        hosts.append("joined " + ", ".join(event.joined_hosts))
    batch = f" (global batch {global_batch} kept)" if global_batch else ""
    return (
        f"rankwise: the job {kind} from {event.old_world} to {event.new_world} ranks"
        f"{' (' + '; '.join(hosts) + ')' if hosts else ''}: continuing from step {event.step} "
        f"out of the replicas in RAM, no disk read; accumulation {event.old_accumulation} -> "
        f"{event.accumulation}{batch}; {event.seconds_lost:.1f} s since that step's replica"
    )
