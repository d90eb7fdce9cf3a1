"""`python -m rankwise.check FILE` runs as its own process and reports through its exit status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "check_corpus"


def test_python_dash_m_rankwise_check() -> None:
    bad = CORPUS / "bad" / "pitfall_sampler_shuffle.py"
    proc = subprocess.run(
        [sys.executable, "-m", "rankwise.check", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"{bad}:14:5: RW003 error [sampler-with-shuffle]" in proc.stdout
