"""A rank SIGKILLed mid-training: the launcher restarts the group, training resumes from the
latest checkpoint, and the final parameters are bit-identical to an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "scripts" / "restart_train.py"


def _launch(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "rankwise",
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(SCRIPT),
        str(tmp / f"ckpt-{name}"),
        str(tmp / f"{name}.pt"),
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_killed_rank_restarts_and_ends_bit_identical(tmp_path):
    straight = _launch(tmp_path, "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _launch(tmp_path, "killed", "--kill-at", "5")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "resumed from step 5" in killed.stdout + killed.stderr
    a = torch.load(tmp_path / "straight.pt", weights_only=True)
    b = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
