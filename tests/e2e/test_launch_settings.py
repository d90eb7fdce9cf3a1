"""``rankwise run`` in a folder with a ``rankwise.toml``, as a user runs it: the file's
``nproc-per-node`` starts that many workers, the launcher names the file, and a flag wins."""

from __future__ import annotations

import subprocess
import sys

# Under --no-prefix both workers write to the one console pipe: each line goes in one write() (a
# print of several items is several writes, which interleave when PYTHONUNBUFFERED is set).
SCRIPT = ('import os, sys\n'
          'sys.stdout.write(f"world {os.environ[\'WORLD_SIZE\']} rank {os.environ[\'RANK\']}\\n")\n')


def _run(cwd, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwise", "run", *flags, "show.py"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_run_reads_rankwise_toml_and_a_flag_overrides_it(tmp_path):
    (tmp_path / "show.py").write_text(SCRIPT)
    (tmp_path / "rankwise.toml").write_text("nproc-per-node = 2\nno-prefix = true\n")
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["world 2 rank 0", "world 2 rank 1"]  # no prefix
    assert "settings from rankwise.toml: nproc-per-node = 2, no-prefix = true" in proc.stderr
    proc = _run(tmp_path, "--nproc-per-node", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "world 1 rank 0"
    assert "the command line overrides --nproc-per-node 1 (the file's 2)" in proc.stderr


def test_config_merges_into_pyproject_and_the_job_starts_its_processes(tmp_path):
    """Issue 43: `[tool.rankwise] nproc-per-node = 2`, then `rankwise config --max-restarts 2`
    wrote a rankwise.toml over it and the job silently started 1 process."""
    (tmp_path / "show.py").write_text(SCRIPT)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.rankwise]\nnproc-per-node = 2\n')
    done = subprocess.run([sys.executable, "-m", "rankwise", "config", "--max-restarts", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "rankwise.toml").exists()
    proc = _run(tmp_path, "--no-prefix")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == ["world 2 rank 0", "world 2 rank 1"]
    assert "nproc-per-node = 2, max-restarts = 2" in proc.stderr
