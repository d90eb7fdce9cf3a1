"""`rankwise run` on the nodes of a ``Cluster``: one launcher per node, output kept in files.

Output goes to ``<folder>/node<i>.out`` / ``.err`` (not pipes), so a test or a benchmark can
read a launcher's stderr while it runs (a stall report, a failure line) and time it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .netns import Cluster, Node


@dataclass
class Launcher:
    """One node's ``rankwise run``."""

    node: Node
    proc: subprocess.Popen
    out: Path
    err: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when it still runs after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""


def rankwise_env(folder: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launcher: this checkout's rankwise first on the path; c10's native
    log files under ``folder`` (TMPDIR)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = [src, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "TMPDIR": str(folder)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("GLOO_SOCKET_IFNAME", None)  # each node chooses its own interface
    return {**env, **(extra or {})}


def start(
    cluster: Cluster,
    node: Node | int,
    args: list[str],
    folder: Path,
    *,
    env: dict[str, str] | None = None,
    name: str | None = None,
    command: list[str] | None = None,
) -> Launcher:
    """Start ``rankwise <args>`` (or ``command``) on ``node`` in ``folder``."""
    n = cluster.node(node)
    name = name or f"node{n.index}"
    out, err = folder / f"{name}.out", folder / f"{name}.err"
    argv = command or [sys.executable, "-m", "rankwise", *args]
    with open(out, "w") as o, open(err, "w") as e:
        proc = cluster.popen(n, argv, cwd=folder, env=rankwise_env(folder, env), stdout=o, stderr=e)
    return Launcher(n, proc, out, err)


def run_flags(
    cluster: Cluster,
    node: Node | int,
    *,
    nproc: int = 2,
    nnodes: int | str | None = None,
    port: int = 29500,
    rdzv: str = "static",
    timeout: int = 120,
) -> list[str]:
    """``rankwise run`` flags for ``node`` of a job over every node of ``cluster``, meeting at
    node 0's address: static (``--node-rank``) or c10d (``--rdzv-endpoint``)."""
    n, master = cluster.node(node), cluster.nodes[0]
    flags = ["run", "--nnodes", str(nnodes or len(cluster.nodes)), "--nproc-per-node", str(nproc),
             "--rdzv-timeout", str(timeout)]  # fmt: skip
    if rdzv == "static":
        return [*flags, "--node-rank", str(n.index), "--master-addr", master.addr,
                "--master-port", str(port)]  # fmt: skip
    return [*flags, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master.addr}:{port}",
            "--rdzv-id", "cluster-job"]  # fmt: skip


def start_job(
    cluster: Cluster,
    script: list[str],
    folder: Path,
    *,
    env: dict[str, str] | None = None,
    **flags,
) -> list[Launcher]:
    """One launcher per node (the last node first: node 0 hosts the store, the others wait)."""
    return [
        start(cluster, n, [*run_flags(cluster, n, **flags), *script], folder, env=env)
        for n in reversed(cluster.nodes)
    ][::-1]


def finish(launchers: list[Launcher], timeout: float) -> list[int]:
    """Every launcher's exit code; one still running after ``timeout`` s in all is killed
    (its code is then None) so a hang fails the test instead of holding it."""
    deadline = time.monotonic() + timeout
    codes = []
    for launcher in launchers:
        code = launcher.wait(max(0.1, deadline - time.monotonic()))
        if code is None:
            launcher.proc.kill()
            launcher.proc.wait()
        codes.append(code)
    return codes


def describe(launchers: list[Launcher], tail: int = 4000) -> str:
    """Every launcher's output tail, for an assertion message."""
    parts = []
    for launcher in launchers:
        parts.append(f"--- node {launcher.node.index} stdout ---\n{launcher.stdout[-tail:]}")
        parts.append(f"--- node {launcher.node.index} stderr ---\n{launcher.stderr[-tail:]}")
    return "\n".join(parts)
