"""Where ``rt.log`` writes: one small class per experiment tracker, all with the same four verbs.

``rt.log_to(log_with=["csv", "tensorboard", "mlflow"], project=..., run_name=..., config=...)``
opens the trackers named (on rank 0 only: ``rankwise.output.metrics.MetricsLogger`` decides who
writes, and reduces across ranks first); each then receives every ``rt.log`` call. A tracker

- opens its run with the project/run names and logs the ``config`` (hyperparameters) once;
- ``log(values, step, wall_time)``: one record of already-reduced floats;
- ``close(failed)``: finishes its run (MLflow: FINISHED/FAILED; W&B: exit code 0/1).

``csv`` and ``jsonl`` need nothing; ``tensorboard``, ``mlflow`` and ``wandb`` are optional
packages (``pip install 'rankwise[mlflow]'``): asking for one that is missing is a
``ConfigError`` naming the extra, raised on every rank alike (so no rank is left waiting).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError

TRACKERS: dict[str, tuple[str, str, str | None]] = {
    # name: (module:class, package to import, extra to install)
    "csv": ("rankwise.trackers.files:CsvTracker", "", None),
    "jsonl": ("rankwise.trackers.files:JsonlTracker", "", None),
    "tensorboard": ("rankwise.trackers.tb:TensorBoardTracker", "tensorboard", "tensorboard"),
    "mlflow": ("rankwise.trackers.mlflow_run:MlflowTracker", "mlflow", "mlflow"),
    "wandb": ("rankwise.trackers.wandb_run:WandbTracker", "wandb", "wandb"),
}
"""Every tracker ``log_with`` may name."""


class Tracker(Protocol):
    """What ``MetricsLogger`` asks of each tracker (rank 0 only)."""

    name: str

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def installed(name: str) -> bool:
    """Whether ``name``'s package can be imported (``csv``/``jsonl``: always)."""
    package = TRACKERS[name][1]
    return not package or importlib.util.find_spec(package) is not None


def resolve(log_with: str | Sequence[str] | None, tensorboard: bool | None) -> list[str]:
    """The trackers to open, checked: known names, packages installed (an error names the
    extra). ``None``: CSV and JSONL, and TensorBoard when installed (or when
    ``tensorboard=True``, which then requires it); ``tensorboard=`` is the older switch and
    goes with ``log_with=None`` only."""
    if log_with is None:
        names = ["csv", "jsonl"]
        if tensorboard or (tensorboard is None and installed("tensorboard")):
            names.append("tensorboard")
    elif tensorboard is not None:
        raise ConfigError(
            f"rt.log_to(log_with={log_with!r}, tensorboard={tensorboard!r}): two ways of "
            "choosing the trackers",
            fix="name them all in log_with, e.g. log_with=['csv', 'tensorboard'].",
        )
    else:
        names = _names(log_with)
    for name in names:
        if not installed(name):
            raise ConfigError(
                f"log_with names {name!r} but the {TRACKERS[name][1]} package is not installed",
                fix=f"pip install 'rankwise[{TRACKERS[name][2]}]', or leave {name!r} out of "
                "log_with.",
            )
    return names


def _names(log_with: str | Sequence[str]) -> list[str]:
    given = [log_with] if isinstance(log_with, str) else list(log_with)
    names: list[str] = []
    for name in given:
        if not isinstance(name, str) or name.lower() not in TRACKERS:
            close = difflib.get_close_matches(str(name).lower(), TRACKERS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"log_with names an unknown tracker {name!r}",
                fix=f"{hint}choose from {', '.join(map(repr, TRACKERS))}.",
            )
        if name.lower() not in names:
            names.append(name.lower())
    if not names:
        raise ConfigError(
            "log_with=[] names no tracker: rt.log would write nowhere",
            fix="name at least one, e.g. log_with=['csv'] (or leave log_with out).",
        )
    return names


def check_init_kwargs(init_kwargs: Mapping[str, Any] | None, names: list[str]) -> dict[str, dict]:
    """``init_kwargs={"wandb": {...}}``: keyword arguments per tracker, for the trackers opened."""
    out: dict[str, dict] = {}
    for name, kwargs in (init_kwargs or {}).items():
        if name not in names:
            raise ConfigError(
                f"init_kwargs has an entry for {name!r}, which log_with={names!r} does not open",
                fix=f"add {name!r} to log_with, or drop init_kwargs[{name!r}].",
            )
        if not isinstance(kwargs, Mapping):
            raise ConfigError(
                f"init_kwargs[{name!r}] is {type(kwargs).__name__}, not a dict of keyword "
                "arguments",
                fix=f"pass init_kwargs={{{name!r}: {{...}}}}.",
            )
        out[name] = dict(kwargs)
    return out


def open_tracker(name: str, log_dir: Path, run: RunInfo, kwargs: dict) -> Tracker:
    """Import and open the tracker ``name`` (its module is imported only now)."""
    module, _, cls = TRACKERS[name][0].partition(":")
    return getattr(importlib.import_module(module), cls)(log_dir, run, **kwargs)


class RunInfo:
    """What every tracker's run is told once: project, run name, configuration."""

    def __init__(
        self, project: str | None, run_name: str | None, config: Mapping[str, Any] | None
    ) -> None:
        if config is not None and not isinstance(config, Mapping):
            raise ConfigError(
                f"config={config!r} is {type(config).__name__}, not a dict of hyperparameters",
                fix="pass config={'lr': 3e-4, 'batch_size': 32, ...} (or vars(args)).",
            )
        self.project = project
        self.run_name = run_name
        self.config: dict[str, Any] = dict(config or {})

    def flat_config(self) -> dict[str, Any]:
        """The configuration as one level of ``a.b`` keys; values numbers, bools or strings
        (what MLflow's params and TensorBoard's hparams take)."""
        return dict(_flatten(self.config, ""))


def _flatten(config: Mapping[str, Any], prefix: str):
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{name}.")
        elif isinstance(value, (bool, int, float, str)):
            yield name, value
        else:
            yield name, json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
