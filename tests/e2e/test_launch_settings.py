"""``rankwise run`` in a folder with a ``rankwise.toml``, as a user runs it: the file's
``nproc-per-node`` starts that many workers, the launcher names the file, and a flag wins."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = 'import os\nprint("world", os.environ["WORLD_SIZE"], "rank", os.environ["RANK"])\n'


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
