"""`rankwise run`'s failure report tells the truth: who raised, what, and the fix that fits.

Real launcher, real DDP over Gloo. Was (issue 34): rank 0 raising ValueError at step 50 read as
"rank 0 had already finished normally ... it will never reach #53", the headline blamed rank 1
("rank(s) 1 never reached the collective that rank(s) 0 waited in") and the Fix blamed a
collective under `if rank == 0:`; uneven data got the same Fix; every failure was printed three
times with Gloo's "Connection closed by peer ... GLHF!" and stray caret lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

RAISES = textwrap.dedent("""
    import os, torch, rankwise as rw
    rt = rw.init(timeout=60)
    model = rw.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        if step == 50 and rt.rank == int(os.environ["RAISER"]):
            raise ValueError(f"bad batch at step {step}")  # raise-site
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
""")

UNEVEN = textwrap.dedent("""
    import torch, rankwise as rw
    from torch.utils.data import DataLoader, TensorDataset
    rt = rw.init(timeout=60)
    n = 80 if rt.rank == 0 else 48  # 10 batches on rank 0, 6 on rank 1, no join
    loader = DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 2)), batch_size=8)
    model = rw.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
""")


def _start(folder, name: str, source: str, **env: str) -> subprocess.Popen:
    folder.mkdir()
    (folder / name).write_text(source)
    return subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", name],
        cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **env},
    )  # fmt: skip


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the job did not end:\n{err[-3000:]}")
    return proc.returncode, err


def _line(source: str, tag: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if f"# {tag}" in text)


def _no_noise(stderr: str) -> None:
    assert "GLHF" not in stderr and "typically caused by a remote worker" not in stderr
    bare = [ln.split(":", 1)[-1].strip() for ln in stderr.splitlines()]
    assert not [ln for ln in bare if ln and set(ln) <= set("^~")], stderr  # no caret lines
    assert stderr.count("Fix: ") == 1, stderr  # one fix, at the end of the summary


def test_the_rank_that_raised_is_named_first_and_nobody_else_is_blamed(tmp_path):
    jobs = {r: _start(tmp_path / f"raiser{r}", "train.py", RAISES, RAISER=str(r)) for r in (0, 1)}
    site = _line(RAISES, "raise-site")
    for raiser, proc in jobs.items():
        other = 1 - raiser
        code, err = _finish(proc)
        assert code == 1, err[-3000:]
        summary = err[err.index("rankwise run: ") :]
        assert summary.startswith(
            f"rankwise run: rank {raiser} raised ValueError: bad batch at step 50 "
        ), summary
        assert f'File "train.py", line {site}' in summary  # the cause, from the user's code
        assert f"Fix: rank {raiser}'s exception is the cause" in summary
        # nobody is blamed who did not fail, and nothing was "finished normally"
        assert "finished normally" not in err and "never reached" not in err
        assert f"rank(s) {other} never" not in err and "if rank == 0" not in err
        assert "until the timeout" not in err
        # headline, the cause, (the diagnosis, when a survivor made one in time), the fix
        order = [summary.index("raised ValueError"), summary.index("Traceback"),
                 summary.index("Fix: ")]  # fmt: skip
        assert order == sorted(order)
        if "  diagnosis:" in summary:
            diagnosis = summary[summary.index("  diagnosis:") :]
            assert f"rank {raiser} raised ValueError: bad batch at step 50" in diagnosis
            assert summary.index("Traceback") < summary.index("  diagnosis:")
        _no_noise(err)


def test_uneven_data_is_named_with_its_fix(tmp_path):
    code, err = _finish(_start(tmp_path / "uneven", "uneven.py", UNEVEN))
    assert code == 1, err[-3000:]
    summary = err[err.index("rankwise run: ") :]
    assert summary.startswith(
        "rankwise run: uneven data: rank(s) 1 ran out of batches and left the training loop "
        "while rank(s) 0 still trained"
    ), summary
    fix = summary[summary.index("Fix: ") :]
    assert "rw.loader(" in fix and "model.join()" in fix
    assert "if rank == 0" not in summary
    _no_noise(err)
