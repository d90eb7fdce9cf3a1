"""``rt.log(metrics, step)``: training curves to CSV, JSON lines and TensorBoard, from rank 0.

Reductions go through ``rankwise.comm`` (one collective per call, whatever the number of
metrics); only rank 0 writes, so N replicas make one curve. TensorBoard files are written by
torch's own ``torch.utils.tensorboard.SummaryWriter`` when the ``tensorboard`` package is
installed (``pip install rankwise[tensorboard]``); CSV and JSONL need nothing.

Files in ``log_dir``: ``metrics.csv`` (long format: ``step,name,value,time`` — new metric
names can appear at any step), ``metrics.jsonl`` (one object per ``log`` call) and the
TensorBoard event files (``tensorboard --logdir log_dir``).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import comm, runtime
from .errors import ConfigError

_REDUCE_OPS = ("mean", "sum", "max", "min")


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"rt.log got {name!r} as a tensor of shape {tuple(value.shape)}; a metric is "
                "one number",
                fix=f"log a scalar, e.g. {name}.mean() or {name}.item().",
            )
        return float(value.detach().float().cpu().item())
    # A number, or a one-element array (numpy): float() would also parse a string ("1.5",
    # "nan"), which is not a metric.
    try:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
            raise TypeError(name)
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"rt.log got {name}={value!r} ({type(value).__name__}), not a number",
            fix="log numbers or one-element tensors.",
        ) from None


def reduce_metrics(values: dict[str, float], op: str) -> dict[str, float]:
    """Every value reduced over the ranks with ``op``, in one collective: under
    ``rw.init(mesh=...)`` over this rank's data group (tensor and pipeline peers hold the same
    batch: a 'sum' of counts would add each one once per peer). Sync point: all ranks (the
    data group's under a mesh)."""
    if op not in _REDUCE_OPS:
        raise ConfigError(
            f"rt.log(reduce={op!r}) is not one of {', '.join(map(repr, _REDUCE_OPS))}",
            fix="pass reduce='mean' (e.g. a loss), 'sum' (counts), 'max' (times) or None.",
        )
    names = sorted(values)  # the same order on every rank, whatever the dict order
    packed = torch.tensor([values[n] for n in names], dtype=torch.float64)
    group = runtime.data_group()
    if group is None:
        reduced = comm.all_reduce(packed, op)
    else:
        reduced = comm.all_reduce_(packed.to(comm._comm_device()), op, group=group, label="rt.log")
    return {n: float(v) for n, v in zip(names, reduced.tolist(), strict=True)}


class MetricsLogger:
    """Rank 0 appends each ``log`` call to CSV, JSONL and (optionally) TensorBoard.

    ``tensorboard``: True (required: an error naming the fix when it is not installed),
    False (never) or None (when installed). Other ranks open no file.
    """

    def __init__(self, log_dir: str | os.PathLike, *, tensorboard: bool | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.is_writer = comm.rank() == 0
        if tensorboard and not tensorboard_available():
            raise ConfigError(
                "tensorboard=True was asked for but the tensorboard package is not installed",
                fix="pip install 'rankwise[tensorboard]' (or tensorboard), or pass "
                "tensorboard=None to write CSV/JSONL only.",
            )
        self.tensorboard = tensorboard_available() if tensorboard is None else tensorboard
        self._step = 0
        self._writer: Any = None
        self._csv: Any = None
        self._jsonl: Any = None
        if self.is_writer:
            self._open()

    def _open(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        csv_path = self.log_dir / "metrics.csv"
        fresh = not csv_path.exists() or csv_path.stat().st_size == 0
        self._csv = open(csv_path, "a", newline="")  # noqa: SIM115 (closed in close())
        if fresh:
            csv.writer(self._csv, lineterminator="\n").writerow(["step", "name", "value", "time"])
        self._jsonl = open(self.log_dir / "metrics.jsonl", "a")  # noqa: SIM115
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def log(
        self, metrics: Mapping[str, Any], step: int | None = None, *, reduce: str | None = None
    ) -> dict[str, float]:
        """Write ``metrics`` at ``step`` (default: one more than the last); return the values
        written (reduced). Sync point: all ranks when ``reduce`` is given."""
        values = {str(k): _as_float(str(k), v) for k, v in metrics.items()}
        if reduce is not None:
            values = reduce_metrics(values, reduce)
        step = self._step if step is None else int(step)
        self._step = step + 1
        if self.is_writer:
            self._write(values, step)
        return values

    def _write(self, values: dict[str, float], step: int) -> None:
        now = time.time()
        rows = csv.writer(self._csv, lineterminator="\n")  # the csv module's default is \r\n
        for name, value in values.items():
            rows.writerow([step, name, repr(value), f"{now:.3f}"])
            if self._writer is not None:
                self._writer.add_scalar(name, value, global_step=step, walltime=now)
        finite = {k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}
        self._jsonl.write(json.dumps({"step": step, **finite, "time": round(now, 3)}) + "\n")
        # Flushed per call: a run that is killed keeps its curve up to the last step.
        self._csv.flush()
        self._jsonl.flush()

    def close(self) -> None:
        for f in (self._csv, self._jsonl, self._writer):
            if f is not None:
                f.close()
        self._csv = self._jsonl = self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
