"""Output under `rankwise run`: bars and prints in order, one prefix, no blank prefixed lines,
--no-prefix --log-dir keeps the files, and a warning when no process joined a group."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TRAIN = textwrap.dedent("""
    import rankwise as rw
    rt = rw.init()
    rw.get_logger("rankwise.demo").info("starting")
    for epoch in range(2):
        for i in rw.progress(range(6), desc=f"epoch {epoch}"):
            if i == 3:
                rt.print(f"mid epoch {epoch}")
        rt.print(f"epoch {epoch} done")
    rw.shutdown()
""")

ALONE = textwrap.dedent("""
    # pytorch/examples' mnist run with two processes: torch, but no process group.
    import torch
    torch.save(torch.zeros(1), "model.pt")
""")


def _run(tmp_path: Path, *flags: str, script: str = "train.py") -> tuple[str, str]:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "alone.py").write_text(ALONE)
    done = subprocess.run(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", *flags, script],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_rank0_output_is_ordered_whole_lines_with_one_prefix(tmp_path):
    out, err = _run(tmp_path)
    lines = [line for line in (out + err).splitlines() if line.startswith("[rank")]
    assert lines and all(line.split(":", 1)[1].strip() for line in lines), lines  # none blank
    assert "[rank0]: starting" in err and "[rank 0/2]" not in out + err  # one prefix
    mine = [line for line in out.splitlines() if line.startswith("[rank0]: ")]
    order = [next(i for i, line in enumerate(mine) if text in line) for text in (
        "mid epoch 0", "epoch 0: 100%", "epoch 0 done", "mid epoch 1", "epoch 1: 100%",
        "epoch 1 done")]  # fmt: skip
    assert order == sorted(order), mine
    assert "never joined a process group" not in err


def test_no_prefix_with_a_log_dir_keeps_every_rank_s_files(tmp_path):
    out, _ = _run(tmp_path, "--no-prefix", "--log-dir", "logs")
    assert "epoch 1 done" in out and "[rank" not in out
    stdout_files = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(stdout_files) == 2
    assert "epoch 1 done" in "".join(p.read_text() for p in stdout_files)


def test_processes_that_never_join_a_group_are_warned_about_once(tmp_path):
    out, err = _run(tmp_path, script="alone.py")
    assert (out + err).count("2 processes were started, but rank 0 never joined") == 1
    assert "Fix: call rw.init()" in err
