"""One record: every rank's step anatomy, averaged over the steps since the last one.

Each rank sums its ``StepSample``s (``Window``); at the cadence every rank packs its means into
a small fixed-size float64 tensor (``FIELDS``), one ``all_gather`` brings every rank's to every
rank (tensors only, never pickles), and ``rows`` turns the table into the per-rank rows of
``steps.jsonl``. Own communication and the wait for peers are told apart here, across ranks:
the rank that arrived last at the step's last sync (the smallest lag) waited for nobody, so its
blocked time is communication alone; every other rank's blocked time beyond that is waiting,
and ``wait_for`` is the rank that arrived last.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch

from .clock import PHASES, StepSample
from .robust import busy

FIELDS = (
    "steps", *PHASES, "other", "total", "cpu", "lag", "ready_lag", "mem", "node", "role",
)
"""The gathered vector, in this order (float64). ``role``: ranks with the same role do the same
work (a pipeline stage's data-parallel replicas); ``mem``: bytes, -1 when unknown; ``cpu``: -1
when no step of the record read the CPU clock (``StepClock.arm``)."""

SUMMED = (*PHASES, "other", "total", "lag", "ready_lag")


class Window:
    """The samples of this rank since the last record (sums; ``means`` at the record)."""

    def __init__(self) -> None:
        self.n = 0
        self.sums = dict.fromkeys(SUMMED, 0.0)
        self.cpu = (0.0, 0.0)
        """CPU and busy seconds of the window's last step that read the CPU (``StepClock.arm``):
        they stand for the window, as ``device`` does (the step after a record is armed too,
        and may be the first of a throttled CPU, still on its fresh quota)."""
        self.device: dict[str, float] = {}
        """A GPU's forward/backward of the window's last step, timed with CUDA events: they
        stand for the window (the host clocks of its other steps saw only the launches)."""

    def add(self, s: StepSample) -> None:
        self.n += 1
        sums = self.sums
        for k, v in s.phases.items():
            sums[k] += v
        sums["other"] += s.other
        sums["total"] += s.total
        sums["lag"] += s.lag
        sums["ready_lag"] += s.ready_lag
        if s.cpu is not None:
            self.cpu = (s.cpu, s.total - s.phases["blocked"])

    def pack(self, *, mem: float, node: int, role: int) -> torch.Tensor:
        """This rank's means as the gathered vector; the window starts again."""
        n = max(self.n, 1)
        values = {k: v / n for k, v in self.sums.items()}
        values.update(self.device)
        # The CPU seconds per busy second of the step that read them, over the mean busy time.
        cpu, busy_s = self.cpu
        values["cpu"] = cpu / busy_s * (values["total"] - values["blocked"]) if busy_s > 0 else -1.0
        values.update(steps=float(self.n), mem=mem, node=node, role=role)
        self.__init__()
        return torch.tensor([values[f] for f in FIELDS], dtype=torch.float64)


_STATM: list[int] = []  # /proc/self/statm, kept open: a read, not an open, per record
_PAGE = resource.getpagesize()


def memory_bytes(device: torch.device | None) -> float:
    """This rank's memory now: the GPU's allocated bytes, else the process's resident set."""
    if device is not None and device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    try:
        if not _STATM or _STATM[1] != os.getpid():  # a forked child reads its own
            _STATM[:] = [os.open("/proc/self/statm", os.O_RDONLY), os.getpid()]
        return float(int(os.pread(_STATM[0], 128, 0).split()[1]) * _PAGE)
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)


def unpack(table: torch.Tensor) -> list[dict[str, float]]:
    """The gathered ``[world, len(FIELDS)]`` table as one dict per rank."""
    return [dict(zip(FIELDS, row, strict=True)) for row in table.tolist()]


def rows(ranks: list[dict[str, float]]) -> list[dict[str, Any]]:
    """The per-rank rows of ``steps.jsonl`` (seconds, bytes), with comm/wait told apart."""
    own = min(r["blocked"] for r in ranks)
    last = min(range(len(ranks)), key=lambda i: (ranks[i]["lag"], i))
    out = []
    for i, r in enumerate(ranks):
        wait = max(0.0, r["blocked"] - own)
        out.append({
            "rank": i, "node": int(r["node"]), "data": r["data"], "forward": r["forward"],
            "backward": r["backward"], "comm": own, "wait": wait,
            "wait_for": last if wait > 0.1 * max(r["total"], 1e-9) and i != last else None,
            "optimizer": r["optimizer"], "checkpoint": r["checkpoint"], "other": r["other"],
            "total": r["total"], "mem": None if r["mem"] < 0 else int(r["mem"]),
            "busy": busy(r), "cpu": None if r["cpu"] < 0 else r["cpu"], "lag": r["lag"], "ready_lag": r["ready_lag"],
            "steps": int(r["steps"]),
        })  # fmt: skip
    return out
