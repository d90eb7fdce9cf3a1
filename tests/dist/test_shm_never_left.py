"""A rank killed while rank 0's shared-memory bucket file is named leaves nothing in /dev/shm.

Each rank kills itself inside the window (``shm_file._IN_WINDOW``: after rank 0 created and
offered the file, before it is unlinked), during a real DistributedDataParallel construction.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.parallel.ddp.node import shared_reduce, shm_file
from rankwise.testing import run_distributed

pytestmark = pytest.mark.skipif(
    not os.path.isdir(shm_file.SHM_DIR) or shutil.disk_usage(shm_file.SHM_DIR).free < 64 * 2**20,
    reason=f"needs 64 MiB free in {shm_file.SHM_DIR}",
)


def _files_of(pid: int) -> list[str]:
    return glob.glob(os.path.join(shm_file.SHM_DIR, f"{shm_file.PREFIX}{pid}-*"))


def _construct_and_die(victim: int, how: str, folder: str) -> None:
    rank = rw.get_runtime().rank
    Path(folder, f"pid{rank}").write_text(str(os.getpid()))
    shared_reduce.MIN_BYTES = 0  # the small net's buckets are shared too
    if rank == victim:
        shm_file._IN_WINDOW = lambda: os.kill(os.getpid(), getattr(signal, how))
    torch.manual_seed(0)
    rw.DistributedDataParallel(nn.Linear(8, 8), shared_memory_reduce=True)


def _run(victim: int, how: str, tmp_path: Path) -> int:
    """Rank 0's pid, after the job failed (the victim died inside the window)."""
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(_construct_and_die, 2, args=(victim, how, str(tmp_path)), timeout=60)
    assert f"rank(s) {victim}" in str(info.value) or f"rank {victim}" in str(info.value)
    return int((tmp_path / "pid0").read_text())


@pytest.mark.parametrize(("victim", "how"), [(1, "SIGKILL"), (0, "SIGTERM"), (1, "SIGTERM")])
def test_a_rank_killed_inside_the_window_leaves_no_file(victim, how, tmp_path):
    pid = _run(victim, how, tmp_path)
    assert _files_of(pid) == []


def test_a_file_left_by_a_sigkilled_rank_0_is_swept_when_the_job_ends(tmp_path):
    # SIGKILL leaves rank 0 no chance to unlink; the launcher (here run_distributed, as
    # `rankwise run` and rw.launch) sweeps files of dead processes when the job ends, and so
    # does the next construction.
    pid = _run(0, "SIGKILL", tmp_path)
    assert _files_of(pid) == []


def test_the_next_construction_sweeps_a_file_of_a_dead_rank_0(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_file, "SHM_DIR", str(tmp_path))
    stale = tmp_path / f"{shm_file.PREFIX}999999999-left"
    stale.write_bytes(b"x" * 64)
    made = shm_file.create(4096)
    assert made is not None and not stale.exists()
    os.unlink(made[0])


def test_the_sweep_spares_files_of_live_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_file, "SHM_DIR", str(tmp_path))
    mine = tmp_path / f"{shm_file.PREFIX}{os.getpid()}-abc"
    dead = tmp_path / f"{shm_file.PREFIX}999999999-abc"
    other = tmp_path / "rankwise-gradsXYZ"
    for f in (mine, dead, other):
        f.write_bytes(b"x")
    assert shm_file.sweep_stale() == [str(dead)]
    assert mine.exists() and other.exists() and not dead.exists()
