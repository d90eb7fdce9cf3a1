"""A real Slurm (tests/cluster/slurm.py: slurmctld + one slurmd per namespace node) running the
two job scripts of docs/launcher.md's Slurm section as written: one task per rank (rankwise
reads the real SLURM_* variables), and one `rankwise run` per node. The first is cancelled with
`scancel` while rank 0 writes a checkpoint: nothing may be left, nothing lost.
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cluster import Cluster, faults, jobs
from cluster.required import require_cluster
from cluster.slurm import Slurm

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).parent / "scripts" / "cluster_train.py"
SHIM = "import runpy, sys\nsys.argv = [{script!r}, *{args!r}]\nrunpy.run_path({script!r}, run_name='__main__')\n"


def docs_scripts() -> dict[str, str]:
    """The job scripts of docs/launcher.md's Slurm section, keyed by how they start ranks."""
    page = (ROOT / "docs" / "launcher.md").read_text()
    section = page[page.index("## Slurm\n") : page.index("## The legacy launcher")]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    scripts = {}
    for block in blocks:
        if "#SBATCH" in block:
            body = "".join(block.splitlines(keepends=True)[1:])  # the `# illustrative` line
            scripts["launcher" if "rankwise run" in block else "per-rank"] = body
    return scripts


@pytest.fixture(scope="module")
def slurm():
    require_cluster(slurm=True)
    with Cluster(2) as cluster:
        s = Slurm(cluster, cpus=4)
        try:
            yield cluster, s.start()
        finally:
            s.close()


def _submit(s: Slurm, folder: Path, script: str, train_args: list[str]) -> int:
    (folder / "train.py").write_text(SHIM.format(script=str(TRAIN), args=train_args))
    (folder / "job.sh").write_text("#!/bin/bash\n" + script)
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"
    return s.sbatch(folder / "job.sh", cwd=folder, env={**jobs.rankwise_env(folder), "PATH": path})


def _envs(folder: Path) -> dict[int, dict]:
    return {int(p.stem[3:]): json.loads(p.read_text()) for p in folder.glob("env*.json")}


def _launcher_job(s: Slurm, folder: Path) -> tuple[int, str]:
    job = _submit(s, folder, docs_scripts()["launcher"], [".", "--steps", "8"])
    return job, s.wait(job, timeout=400)


def test_the_docs_scripts_run_on_slurm_and_scancel_leaves_nothing(slurm, tmp_path: Path):
    cluster, s = slurm
    scripts = docs_scripts()
    assert sorted(scripts) == ["launcher", "per-rank"]
    per_node, per_rank = tmp_path / "launcher", tmp_path / "per-rank"
    per_node.mkdir(), per_rank.mkdir()
    with ThreadPoolExecutor(1) as pool:  # the per-node launcher job runs beside the other
        launched = pool.submit(_launcher_job, s, per_node)
        job = _submit(s, per_rank, scripts["per-rank"],
                      [".", "--big", "--steps", "100000", "--save-every", "3"])  # fmt: skip
        ckpt = per_rank / "ckpt"
        started = faults.wait_until(lambda: (per_rank / "saved").exists(), 400)
        assert started is not None, (per_rank / f"slurm-{job}.out").read_text()[-3000:]
        mid_write = faults.wait_until(lambda: any(ckpt.glob(".ckpt-*.tmp")), 120, poll=0.01)
        done = s.command(["scancel", str(job)])
        assert done.returncode == 0, done.stderr
        assert s.wait(job, timeout=120) == "CANCELLED"
        launcher_job, launcher_state = launched.result(timeout=600)
    _check_per_rank(cluster, per_rank, mid_write is not None)
    _check_launcher(per_node, launcher_job, launcher_state)


def _check_per_rank(cluster: Cluster, folder: Path, mid_write: bool) -> None:
    envs = _envs(folder)
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, e in envs.items():  # rankwise read the real SLURM_* variables
        assert e["source"] == "slurm" and e["world"] == 4, e
        assert (e["node"], e["local"], e["master"]) == (rank // 2, rank % 2, "node0"), e
        assert e["host"] == f"node{rank // 2}", e
    pids = {e["pid"] for e in envs.values()}
    gone = faults.wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids), 60)
    assert gone is not None, "ranks outlived scancel"
    daemons = faults.wait_until(lambda: not _job_processes(cluster), 60)
    assert daemons is not None, f"left on the nodes after scancel: {_job_processes(cluster)}"
    left = [n for n in os.listdir("/dev/shm") if any(f"-{p}-" in n for p in pids)]
    assert left == [], left
    assert mid_write, "scancel did not land inside a checkpoint's write"
    assert faults.checkpoint_ok(folder, big=True), "latest does not load or lost a save"
    import rankwise as rw

    rw.save_checkpoint(folder / "ckpt", model=torch.nn.Linear(2, 2), step=10**6)
    assert not list((folder / "ckpt").glob(".*.tmp")), "the next save left the cancelled one's"


def _job_processes(cluster: Cluster) -> list[str]:
    """Every process on the nodes but the Slurm daemons (slurmctld's helper slurmscriptd too)."""
    left = []
    for node in range(len(cluster.nodes)):
        for pid in cluster.pids(node):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            words = [os.path.basename(w) for w in cmd.replace(":", " ").split()[:1]]
            if words not in (["slurmd"], ["slurmctld"], ["slurmscriptd"]):
                left.append(f"node{node} {pid}: {cmd[:120]}")
    return left


def _check_launcher(folder: Path, job: int, state: str) -> None:
    out = (folder / f"slurm-{job}.out").read_text() if (folder / f"slurm-{job}.out").exists() else ""
    assert state == "COMPLETED", out[-3000:]
    assert "[rank0]: done: 8 steps, world size 4" in out, out[-3000:]
    envs = _envs(folder)
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, e in envs.items():  # one launcher per Slurm node, two workers each
        assert e["source"] == "launcher" and (e["node"], e["local"]) == (rank // 2, rank % 2)
        assert e["host"] == f"node{rank // 2}" and e["master"] == "node0", e
    states = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(4)]
    assert all(torch.equal(s[k], states[0][k]) for s in states for k in s)
