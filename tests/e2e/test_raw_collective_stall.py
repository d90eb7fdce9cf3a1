"""A mismatch of raw torch.distributed collectives is reported within the stall window, and the
job ends then, not at the timeout.

The script calls torch.distributed directly (not through rankwise): rank 0 all_reduce, rank 1
recv. Without the report, both wait for the backend's timeout and read gloo's "Timed out".
Was: reported at the stall window, but the job still ran to the timeout (here 600 s, past the
test's 240 s limit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import rankwise as rw

    rt = rw.init(timeout=600)
    t = torch.ones(4)
    if rt.rank == 0:
        dist.all_reduce(t)  # all-reduce-site
    else:
        dist.recv(t, src=0)  # recv-site
""")


def test_a_raw_collective_mismatch_is_reported_and_ends_the_job_before_the_timeout(tmp_path):
    (tmp_path / "mismatch.py").write_text(SCRIPT)
    lines = SCRIPT.splitlines()
    a = next(i for i, t in enumerate(lines, 1) if "all-reduce-site" in t)
    r = next(i for i, t in enumerate(lines, 1) if "recv-site" in t)
    out = subprocess.run(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "mismatch.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "RANKWISE_STALL_REPORT_S": "3"},
    )  # fmt: skip
    assert out.returncode != 0
    report = next(
        (ln for ln in out.stderr.splitlines() if "stall in a torch.distributed collective" in ln),
        None,
    )
    assert report is not None, out.stderr[-3000:]
    assert f"rank 0 is in torch.distributed.all_reduce (from mismatch.py:{a})" in report
    assert f"rank 1 is in torch.distributed.recv (from mismatch.py:{r})" in report
    assert "different collectives (a mismatch" in report
    workers = [ln for ln in out.stderr.splitlines() if ln.startswith("[rank")]
    assert sum("stall in a torch.distributed collective" in ln for ln in workers) == 1  # once
    assert "rankwise ends the job now" in report or "rankwise ends the job now" in out.stderr
    assert "[rank 0] ending this rank (exit code 1)" in out.stderr
    summary = out.stderr[out.stderr.index("rankwise run: ") :]
    assert "  diagnosis:" in summary and "different collectives (a mismatch" in summary
