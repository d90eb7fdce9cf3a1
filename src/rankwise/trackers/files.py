"""The trackers that need no package: ``metrics.csv`` and ``metrics.jsonl`` in the log folder.

``metrics.csv`` is long format (``step,name,value,time``: new metric names can appear at any
step); ``metrics.jsonl`` holds one object per ``rt.log`` call. Both are appended to (a
resumed run continues its curve) and flushed per call (a killed run keeps its curve up to
the last step). The run's ``config`` goes to ``config.json`` beside them.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import RunInfo


def _write_config(log_dir: Path, run: RunInfo) -> None:
    if run.config:
        text = json.dumps(run.config, indent=2, sort_keys=True, default=str)
        (log_dir / "config.json").write_text(text + "\n")


class CsvTracker:
    name = "csv"

    def __init__(self, log_dir: Path, run: RunInfo) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "metrics.csv"
        fresh = not path.exists() or path.stat().st_size == 0
        self.file = open(path, "a", newline="")  # noqa: SIM115 (closed in close())
        self._rows = csv.writer(self.file, lineterminator="\n")  # the module's default is \r\n
        if fresh:
            self._rows.writerow(["step", "name", "value", "time"])
        _write_config(log_dir, run)

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        for name, value in values.items():
            self._rows.writerow([step, name, repr(value), f"{wall_time:.3f}"])
        self.file.flush()

    def close(self, failed: bool = False) -> None:
        self.file.close()


class JsonlTracker:
    name = "jsonl"

    def __init__(self, log_dir: Path, run: RunInfo) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(log_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        _write_config(log_dir, run)

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        # JSON has no NaN/inf: non-finite values are written as the strings "nan", "inf".
        finite = {k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}
        self.file.write(json.dumps({"step": step, **finite, "time": round(wall_time, 3)}) + "\n")
        self.file.flush()

    def close(self, failed: bool = False) -> None:
        self.file.close()
