"""What every benchmark does with its result: print the JSON, and write it to ``--out`` too."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | Path | None) -> dict:
    """Print ``result`` as indented JSON and, when ``out`` is given, write it there as well."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result
