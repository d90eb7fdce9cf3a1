"""A real Slurm on the test cluster: ``slurmctld`` on node 0, one ``slurmd`` per node.

Debian's ``slurm-wlm`` (22.05) daemons, each in its node's network namespace and in a UTS
namespace of its own whose hostname is the node's name (``node0``, ``node1``...), as on a real
cluster: ``slurmd`` finds its ``NodeName`` from the hostname, and a job's processes inherit
both (``SLURM_JOB_NODELIST=node[0-1]``, ``hostname`` says ``node1``). Authentication is
``auth/none`` + ``cred/none`` (test-only plugins 22.05 still ships: no munge daemon, no key).
State, spool and logs live in a temporary folder named ``rwc-<pid>-...-slurm``; the daemons die
with the cluster's namespaces, the folder with ``close()`` (or the next ``sweep``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .netns import PREFIX, Cluster, Unavailable, _alive, _owner

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "scontrol", "sinfo")
CONF = """\
ClusterName=rwc
SlurmctldHost=node0({master})
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def unavailable() -> str | None:
    """Why no Slurm can be started here (the package is missing), or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm"
    return None


def sweep_folders() -> list[str]:
    """Remove Slurm folders whose owner process is gone."""
    stale = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-slurm"):
        owner = _owner(path.name)
        if owner is not None and not _alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            stale.append(str(path))
    return stale


class Slurm:
    """Controller on node 0, a ``slurmd`` on every node of ``cluster``, ``cpus`` each."""

    def __init__(self, cluster: Cluster, cpus: int = 2) -> None:
        self.cluster, self.cpus = cluster, cpus
        self.folder = Path(tempfile.mkdtemp(prefix=f"{cluster.tag}-", suffix="-slurm"))
        self.conf = self.folder / "slurm.conf"

    def start(self, timeout: float = 120) -> Slurm:
        reason = unavailable()
        if reason:
            raise Unavailable(reason)
        sweep_folders()
        (self.folder / "state").mkdir()
        nodes = "\n".join(
            f"NodeName={n.hostname} NodeAddr={n.addr} CPUs={self.cpus} State=UNKNOWN"
            for n in self.cluster.nodes
        )
        master = self.cluster.nodes[0].addr
        self.conf.write_text(CONF.format(master=master, d=self.folder, nodes=nodes))
        # slurmd 22.05 initialises a cgroup plugin even when nothing uses cgroups (proctrack
        # linuxproc, task none): an empty tmpfs, in the daemon's own mount namespace, is enough.
        (self.folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        self._daemon(0, ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for n in self.cluster.nodes:
            (self.folder / "spool" / n.hostname).mkdir(parents=True)
            self._daemon(n.index, ["slurmd", "-D", "-f", str(self.conf)], f"slurmd-{n.hostname}")
        self.wait_idle(timeout)
        return self

    def _daemon(self, node: int, argv: list[str], name: str) -> None:
        hostname = self.cluster.nodes[node].hostname
        # `ip netns exec` gave the daemon a mount namespace of its own: the tmpfs stays there.
        script = f'mount -t tmpfs none /sys/fs/cgroup && hostname {hostname} && exec "$@"'
        log = open(self.folder / f"{name}.out", "w")  # noqa: SIM115 - the daemon's, kept open
        self.cluster.popen(node, ["unshare", "--uts", "sh", "-c", script, "sh", *argv],
                           stdout=log, stderr=subprocess.STDOUT, env=self.env())  # fmt: skip

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **(extra or {})}

    def command(self, argv: list[str], *, node: int = 0, cwd: Path | None = None,
                env: dict[str, str] | None = None, timeout: float = 60):  # fmt: skip
        """A Slurm client command (``sbatch``, ``squeue``...) run on ``node`` as that host."""
        hostname = self.cluster.nodes[node].hostname
        wrapped = ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh"]
        return self.cluster.run(node, [*wrapped, *argv], timeout=timeout, cwd=cwd,
                                env=self.env(env))  # fmt: skip

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            done = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
            states = done.stdout.strip()
            lines = [line.split() for line in states.splitlines()]
            if len(lines) == len(self.cluster.nodes) and all(s == "idle" for _, s in lines):
                return
            time.sleep(1)
        raise Unavailable(f"Slurm nodes not idle after {timeout:.0f}s: {states!r}; "
                          f"logs in {self.folder}")  # fmt: skip

    def sbatch(self, script: Path, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        done = self.command(["sbatch", "--parsable", str(script), *args], cwd=cwd, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def state(self, job: int) -> str:
        """The job's state ('PENDING', 'RUNNING', 'COMPLETED', 'CANCELLED', 'FAILED'...)."""
        done = self.command(["scontrol", "show", "job", str(job), "-o"], timeout=30)
        for field in done.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait(self, job: int, timeout: float, until: tuple[str, ...] = ("COMPLETED", "FAILED",
             "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> str:  # fmt: skip
        deadline = time.monotonic() + timeout
        state = self.state(job)
        while state not in until and time.monotonic() < deadline:
            time.sleep(0.5)
            state = self.state(job)
        return state

    def close(self) -> None:
        """The daemons die with the cluster's namespaces; this removes the folder."""
        shutil.rmtree(self.folder, ignore_errors=True)
