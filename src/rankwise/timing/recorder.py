"""The recorder: closes each step, gathers every rank's anatomy at the cadence, names stragglers.

``on_step`` runs at the end of every optimizer step (the session's optimizer hook). Every
``every``-th step (default 10), and every step while a straggler is suspected, each rank packs
the means of its steps since the last record into a small float64 tensor and one
``all_gather`` brings them to every rank (``record``). The gather is posted at that step and
taken at the next one's end (``_post``, ``_complete``): its latency hides behind a step of
compute, and the record is published one step later. Every rank runs the same ``Attributor``
on the same table, so they agree on when to gather densely without another message. Rank 0
then writes the record to the run directory (``files``), prints one line when a straggler
appears or is gone, and hands the rows to the listeners (the trackers).

When attribution suspects a slow link (``Attributor.want_probe``), the record also times a
transfer of ``links.PROBE_BYTES`` from each of a few peers on every rank (``_probe``) and
gathers the times: the node whose every transfer is slow is the slow link's.

Sync point: all ranks, at every recorded step (the gather; the probe when asked for). Every
rank steps its optimizer the same number of times under a synchronous strategy; an asynchronous
one is not recorded.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm import collectives
from ..output.log import write
from . import clock as clocks
from . import links
from .attribution import Attributor, Settings, Straggler
from .files import RunFiles
from .record import FIELDS, Window, memory_bytes, rows, unpack
from .summary import Totals

Listener = Callable[[int, list[dict[str, Any]], "Straggler | None"], None]

DEFAULT_EVERY = 10
"""Steps between records by default (``RANKWISE_PROFILE_STEPS`` / ``--profile-steps``): the
same figure as ``rankwise.timing.DEFAULT_EVERY``."""


class Recorder:
    """Step anatomy of this process, gathered at the cadence (see the module docstring)."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        strategy: str,
        device: torch.device,
        every: int = DEFAULT_EVERY,
        node: int = 0,
        role: int = 0,
        run_dir: str | Path | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.rank, self.world, self.strategy = rank, world, strategy
        self.device, self.every, self.node, self.role = device, max(1, every), node, role
        self.clock = clocks.StepClock(device_type=device.type)
        self.window = Window()
        self.attributor = Attributor(settings or Settings(), host_clocks=device.type != "cuda")
        self.step = 0
        self.listeners: list[Listener] = []
        self.totals = Totals()
        self.events: list[dict[str, Any]] = []
        self.files: RunFiles | None = None
        self.pending: tuple[int, bool, list[torch.Tensor], Any] | None = None
        """The posted record: (its step, dense, the gather's slots, its work)."""
        if rank == 0 and run_dir is not None:
            run = {"world": world, "strategy": strategy, "every": self.every, "fields": FIELDS}
            self.files = RunFiles(run_dir, run)

    def on_step(self) -> None:
        """The end of one optimizer step. Sync point: all ranks on a recorded step."""
        armed = self.clock.armed and self.clock.device is not None
        sample = self.clock.finish_step()
        self.window.add(sample)
        if armed:
            self.window.device = {k: sample.phases[k] for k in clocks.DEVICE_PHASES}
        self.step += 1
        due = self.step % self.every == 0
        if self.pending is not None or due:
            t0 = time.perf_counter()
            clocks.install(None)  # the record's own waits (its gather) mark no phase
            try:
                if self.pending is not None:  # the last record's gather, done meanwhile
                    self._complete()
                if due or self.attributor.want_dense():
                    self._post()
            finally:
                clocks.install(self.clock)
            # The record's own time (its gather, rank 0's writes) is no phase of the next
            # step: benchmarks/step_anatomy.py measures it as timing's cost.
            self.clock.start += time.perf_counter() - t0
        # Armed: the step before a record, every dense one, and the one after a record is
        # posted (when that record flags a rank, the next is dense and covers that step alone).
        due_next = (self.step + 1) % self.every == 0
        self.clock.arm(due_next or self.pending is not None or self.attributor.want_dense())

    def record(self) -> None:
        """Gather every rank's means since the last record; attribute; rank 0 publishes."""
        if self.pending is not None:
            self._complete()
        self._post()
        self._complete()

    def _post(self) -> None:
        """Pack this rank's means and post their gather (the next step runs meanwhile: the
        gather's latency hides behind it; ``_complete`` at the step's end takes the table)."""
        mine = self.window.pack(mem=memory_bytes(self.device), node=self.node, role=self.role)
        dense = self.attributor.want_dense()
        if self.world == 1:
            self.pending = (self.step, dense, [mine], None)
            return
        device = collectives._comm_device()
        slots, work = collectives.all_gather_tensors_async(mine.to(device), label="step timing")
        self.pending = (self.step, dense, slots, work)

    def _complete(self) -> None:
        """The posted record's table: attribute (the same on every rank), probe the links when
        asked, rank 0 publishes."""
        assert self.pending is not None
        step, dense, slots, work = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        ranks = unpack(torch.stack(slots).cpu())
        # One process has no peer to slow down: its anatomy is recorded, nobody is named.
        events = self.attributor.observe(step, ranks, dense) if self.world > 1 else []
        if self.attributor.want_probe():
            self.attributor.probed(self._probe(), [int(r["node"]) for r in ranks])
        if self.rank == 0:
            self._publish(step, rows(ranks), events)

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return mine[None]
        device = collectives._comm_device()
        parts = collectives.all_gather_tensors(mine.to(device), label="step timing")
        return torch.stack(parts).cpu()

    def _probe(self) -> list[list[float]]:
        """Every rank's seconds waiting for ``PROBE_BYTES`` from each of ``links.shifts``'s
        peers, gathered (the ranks post their sends and receives together, one shift at a
        time). Plain point-to-point and all-gather of float64 tensors: the timing's own
        messages, every rank taking part by the same decision."""
        device = collectives._comm_device()
        out = torch.zeros(links.PROBE_BYTES // 8, dtype=torch.float64, device=device)
        into = torch.empty_like(out)
        mine = []
        for k in links.shifts(self.world):
            dist.barrier()  # every rank starts the shift together: a late sender is no slow link
            t0 = time.perf_counter()
            ops = [dist.P2POp(dist.isend, out, (self.rank + k) % self.world),
                   dist.P2POp(dist.irecv, into, (self.rank - k) % self.world)]  # fmt: skip
            send, recv = dist.batch_isend_irecv(ops)
            recv.wait()
            mine.append(time.perf_counter() - t0)
            send.wait()
        table = self._gather(torch.tensor(mine, dtype=torch.float64))
        return table.tolist()

    def _publish(self, step: int, table: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        named = self.attributor.named
        self.totals.add(table)
        if self.files is not None:
            self.files.step({"step": step, "t": time.time(), "world": self.world,
                             "strategy": self.strategy, "ranks": table,
                             "straggler": None if named is None else named.fields()})  # fmt: skip
        for event in events:
            self.events.append(event)
            write(event["text"], file=sys.stderr)
            if self.files is not None:
                self.files.event(event)
        for listener in self.listeners:
            listener(step, table, named)

    def close(self) -> str:
        """Stop recording; return the end-of-run summary (rank 0; '' elsewhere or if empty)."""
        if clocks.current() is self.clock:
            clocks.install(None)
        if self.pending is not None:  # the last record (every rank closes: its gather ends)
            self._complete()
        text = self.totals.table(self.events) if self.rank == 0 else ""
        if self.files is not None:
            if text:
                (self.files.folder / "summary.txt").write_text(text + "\n")
            self.files.close()
            self.files = None
        return text
