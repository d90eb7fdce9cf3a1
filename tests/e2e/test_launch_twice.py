"""Two launches from one process (a notebook, a test session) are two jobs.

Was: ``launch`` left the variables it sets for its workers in the caller's environment, so the
second job wrote its step records into the first job's run directory (and under
``pytest -n 2`` a later test's ``rankwise run`` found no ``logs/runs`` at all: it inherited an
earlier test's ``RANKWISE_RUN_DIR``). The caller's environment must come back unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

TRAIN = """
import rankwise as rw, torch
rt = rw.init(strategy="ddp")
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = rt.prepare(model, opt)
for _ in range(3):
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""

DRIVER = """
import json, os, sys
from rankwise.launch import LaunchOptions, launch
before = dict(os.environ)
for _ in range(2):
    launch(LaunchOptions(script="train.py", nproc_per_node=1, log_dir="logs", profile_steps=1))
after = dict(os.environ)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
print(json.dumps(changed))
"""


def test_two_launches_in_one_process_get_two_run_dirs_and_leave_the_env_as_it_was(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    changed = json.loads(done.stdout.strip().splitlines()[-1])
    assert changed == [], f"launch left these variables changed: {changed}"
    runs = sorted(p.name for p in (tmp_path / "logs" / "runs").iterdir())
    assert len(runs) == 2, runs
    for run in runs:  # each job's records went into its own folder
        assert any((tmp_path / "logs" / "runs" / run).iterdir()), run
