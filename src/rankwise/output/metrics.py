"""``rt.log(metrics, step)``: training curves from rank 0, to the trackers ``rt.log_to`` opened.

Reductions go through ``rankwise.comm.collectives`` (one collective per call, whatever the number of
metrics); only rank 0 writes, so N replicas make one curve. Where it writes is a list of
trackers (``rankwise.trackers``): ``csv`` (``metrics.csv``, long format ``step,name,value,time``:
new metric names can appear at any step), ``jsonl`` (``metrics.jsonl``, one object per call),
``tensorboard`` (torch's ``SummaryWriter``), ``mlflow`` (a local SQLite store by default) and
``wandb`` (``WANDB_MODE=offline`` for no network). The default is CSV, JSONL and TensorBoard
when installed. The trackers' runs are finished by ``rw.shutdown()`` or at exit (FAILED, exit
code 1, after an unhandled exception).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import runtime, trackers
from ..comm import collectives as comm
from ..errors import ConfigError

_REDUCE_OPS = ("mean", "sum", "max", "min")


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
    """Rank 0 sends each ``log`` call to its trackers (``rankwise.trackers``); other ranks open
    nothing, but check the same arguments (a missing package fails on every rank alike).

    ``log_with``: tracker names (``"csv"``, ``"jsonl"``, ``"tensorboard"``, ``"mlflow"``,
    ``"wandb"``); None: CSV, JSONL and TensorBoard when installed. ``tensorboard``: the older
    switch, with ``log_with=None`` only: True (required), False (never), None (when
    installed). ``project``/``run_name``: the trackers' experiment/project and run names;
    ``config``: hyperparameters, logged once; ``init_kwargs``: per tracker,
    ``{"wandb": {...}}`` for ``wandb.init``, ``{"mlflow": {"tracking_uri": ...}}``,
    ``{"tensorboard": {...}}`` for ``SummaryWriter``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        tensorboard: bool | None = None,
        log_with: str | Sequence[str] | None = None,
        project: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.is_writer = comm.rank() == 0
        self.names = trackers.resolve(log_with, tensorboard)
        """The trackers this logger writes to (on rank 0)."""
        self.tensorboard = "tensorboard" in self.names
        kwargs = trackers.check_init_kwargs(init_kwargs, self.names)
        run = trackers.RunInfo(project, run_name, config)
        self._step = 0
        self._closed = False
        self._trackers: dict[str, trackers.Tracker] = {}
        if self.is_writer:
            try:
                for name in self.names:
                    tracker = trackers.open_tracker(name, self.log_dir, run, kwargs.get(name, {}))
                    self._trackers[name] = tracker
            except BaseException:
                self.close(failed=True)
                raise
            _remember(self)

    def tracker(self, name: str) -> Any:
        """The open tracker ``name`` (``.writer`` for TensorBoard, ``.client``/``.run_id`` for
        MLflow, ``.run`` for W&B); None on ranks other than 0, which open none."""
        if name not in self.names:
            raise ConfigError(
                f"tracker({name!r}): this logger writes to {self.names}",
                fix=f"open it with rt.log_to(log_with=[..., {name!r}]).",
            )
        return self._trackers.get(name)

    def log(
        self, metrics: Mapping[str, Any], step: int | None = None, *, reduce: str | None = None
    ) -> dict[str, float]:
        """Write ``metrics`` at ``step`` (default: one more than the last); return the values
        written (reduced). Sync point: all ranks when ``reduce`` is given."""
        if self._closed:
            raise ConfigError(
                f"rt.log after its trackers were closed (rw.shutdown() or close()) in {self.log_dir}",
                fix="log before rw.shutdown(), or open them again with rt.log_to(...).",
            )
        values = {str(k): _as_float(str(k), v) for k, v in metrics.items()}
        if reduce is not None:
            values = reduce_metrics(values, reduce)
        step = self._step if step is None else int(step)
        self._step = step + 1
        now = time.time()
        for tracker in self._trackers.values():
            tracker.log(values, step, now)
        return values

    def log_series(self, values: Mapping[str, float], step: int) -> None:
        """Write library series (the step anatomy per rank, ``rankwise.timing``) at the
        training ``step``, as they are: no reduction, and ``rt.log``'s own step count is left
        alone. Rank 0 only (others have no trackers); nothing after ``close``. No sync point."""
        if self._closed:
            return
        now = time.time()
        for tracker in self._trackers.values():
            tracker.log({str(k): float(v) for k, v in values.items()}, int(step), now)

    def close(self, failed: bool = False) -> None:
        """Finish every tracker's run (``failed``: MLflow FAILED, W&B exit code 1). Twice is
        harmless."""
        self._closed = True
        opened, self._trackers = self._trackers, {}
        for tracker in opened.values():
            tracker.close(failed)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)


_open_loggers: weakref.WeakSet[MetricsLogger] = weakref.WeakSet()


def _remember(logger: MetricsLogger) -> None:
    """Close ``logger`` at ``rw.shutdown()`` or at exit, whichever comes first. The exit hook
    is registered again after each open so it runs before the hooks a tracker registered
    (W&B's): ours says whether the run failed."""
    _open_loggers.add(logger)
    runtime.on_shutdown(_close_on_leave, always=True)
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)


def _close_open(failed: bool = False) -> None:
    for logger in list(_open_loggers):
        logger.close(failed)
    _open_loggers.clear()


def _close_on_leave() -> None:
    # rw.shutdown() in a ``finally:`` while an exception propagates: the run failed.
    _close_open(failed=sys.exc_info()[1] is not None)


def _close_at_exit() -> None:
    # After an unhandled exception the interpreter has set sys.last_value before atexit runs.
    _close_open(failed=getattr(sys, "last_value", None) is not None)
