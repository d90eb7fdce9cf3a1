"""What every benchmark does with its result: print the JSON, and write it to ``--out`` too."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def emit(result: dict, out: str | Path | None) -> dict:
    """Print ``result`` as indented JSON and, when ``out`` is given, write it there as well."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result


def wait_until(cond: Callable[[], object], timeout: float, poll: float = 0.02) -> float | None:
    """Seconds until ``cond()`` holds, or None after ``timeout`` (fault benchmarks poll jobs)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(poll)
    return None
