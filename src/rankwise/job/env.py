"""Where this process sits in the job: rank, local_rank, world size, node, master address.

This is the ONLY module that reads ``os.environ``. Every other module receives a ``DistEnv``.
Sources, tried in order: a torchrun-style launcher (ours or torch's), Slurm, Open MPI, and
finally nothing at all, which means a single process (world size 1) — the normal case.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .. import validate
from ..errors import EnvError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT_S = 300.0
"""Finite default for every collective and the rendezvous (``rw.init``, the launcher's
``--rdzv-timeout``): a hang becomes an error. Defined here, the bottom layer, so that the
launcher (which never imports torch) and the runtime share one value."""


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """The coordinates of one process in a distributed job."""

    rank: int = 0
    """Global index of this process, 0 .. world_size-1. Rank 0 is the master."""
    local_rank: int = 0
    """Index of this process on its machine; selects the device (``cuda:local_rank``)."""
    world_size: int = 1
    """Total number of processes in the job."""
    local_world_size: int = 1
    """Number of processes on this machine."""
    node_rank: int = 0
    """Index of this machine (node) in the job."""
    nnodes: int = 1
    """Number of machines (nodes) in the job."""
    master_addr: str = DEFAULT_MASTER_ADDR
    """Host of rank 0's rendezvous store."""
    master_port: int = DEFAULT_MASTER_PORT
    """Port of rank 0's rendezvous store."""
    source: str = "single"
    """Where the values came from: 'launcher', 'slurm', 'mpi' or 'single'."""
    restart_count: int = 0
    """How often the launcher restarted the worker group (``--max-restarts``); 0 at first."""
    agent_store: bool = False
    """True when the launcher's agent hosts the store and every rank connects as a client."""

    def __post_init__(self) -> None:
        # A DistEnv built by hand: its fields by type first (detect() parses ints itself).
        for name in ("rank", "local_rank", "world_size", "local_world_size", "node_rank",
                     "nnodes", "master_port", "restart_count"):  # fmt: skip
            validate.integer(name, getattr(self, name), where="DistEnv()")
        validate.text("master_addr", self.master_addr, where="DistEnv()")
        # Errors name the variables the values were read from (SLURM_PROCID, not RANK, on Slurm).
        n = _NAMES.get(self.source, _NAMES["launcher"])
        _check_index(n["rank"], self.rank, n["world_size"], self.world_size, self.source)
        _check_index(
            n["local_rank"],
            self.local_rank,
            n["local_world_size"],
            self.local_world_size,
            self.source,
        )
        _check_index(n["node_rank"], self.node_rank, n["nnodes"], self.nnodes, self.source)
        if self.local_world_size > self.world_size:
            raise EnvError(
                f"{n['local_world_size']}={self.local_world_size} is larger than "
                f"{n['world_size']}={self.world_size} (source: {self.source})",
                fix="a machine cannot hold more processes than the whole job; check the launcher flags.",
            )
        if not 0 < self.master_port < 65536:
            raise EnvError(
                f"MASTER_PORT={self.master_port} is not a TCP port (source: {self.source})",
                fix="use a port in 1..65535, e.g. MASTER_PORT=29500.",
            )

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        """True on global rank 0, the process that prints, logs and saves."""
        return self.rank == 0

    @property
    def is_local_master(self) -> bool:
        """True on local rank 0 of each machine."""
        return self.local_rank == 0


_NAMES: dict[str, dict[str, str]] = {
    "launcher": {
        "rank": "RANK",
        "world_size": "WORLD_SIZE",
        "local_rank": "LOCAL_RANK",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "node_rank": "NODE_RANK",
        "nnodes": "NNODES",
    },
    "slurm": {
        "rank": "SLURM_PROCID",
        "world_size": "SLURM_NTASKS",
        "local_rank": "SLURM_LOCALID",
        "local_world_size": "SLURM_TASKS_PER_NODE",
        "node_rank": "SLURM_NODEID",
        "nnodes": "SLURM_JOB_NUM_NODES",
    },
    "mpi": {
        "rank": "OMPI_COMM_WORLD_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "node_rank": "OMPI_COMM_WORLD_NODE_RANK",
        "nnodes": "nnodes (world size / local size)",
    },
}
"""Per source, the environment variable each field is read from (for error messages)."""


def _check_index(name: str, value: int, size_name: str, size: int, source: str) -> None:
    if size < 1:
        raise EnvError(
            f"{size_name}={size} must be at least 1 (source: {source})",
            fix=f"set {size_name} to the number of processes, e.g. {size_name}=2.",
        )
    if not 0 <= value < size:
        raise EnvError(
            f"{name}={value} is out of range for {size_name}={size} (source: {source}): "
            f"expected 0 <= {name} < {size}",
            fix=f"{name} counts from 0; either raise {size_name} or lower {name}.",
        )


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(
                f"{name} is not set but other launcher variables are",
                fix=f"launch with `rankwise run` / torchrun / srun / mpirun, which set it, "
                f"or set {name} yourself.",
            )
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise EnvError(
            f"{name}={raw!r} is not an integer",
            fix=f"set {name} to a whole number such as {name}=0.",
        ) from None


def _from_launcher(e: Mapping[str, str]) -> DistEnv:
    world = _int(e, "WORLD_SIZE")
    rank = _int(e, "RANK")
    local_rank = _int(e, "LOCAL_RANK", 0 if world == 1 else None)
    local_world = _int(e, "LOCAL_WORLD_SIZE", world)
    nnodes = _int(e, "NNODES", _int(e, "GROUP_WORLD_SIZE", max(1, world // local_world)))
    node_rank = _int(e, "NODE_RANK", _int(e, "GROUP_RANK", rank // local_world))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        nnodes=nnodes,
        master_addr=e.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=_int(e, "MASTER_PORT", DEFAULT_MASTER_PORT),
        source="launcher",
        restart_count=_int(e, "TORCHELASTIC_RESTART_COUNT", 0),
        agent_store=e.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[03-05,07],cpu1' -> 'gpu03'."""
    nodelist = nodelist.strip()
    m = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m or not nodelist:
        raise EnvError(
            f"SLURM_JOB_NODELIST={nodelist!r} cannot be parsed",
            fix="set MASTER_ADDR to the first node's host name.",
        )
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def slurm_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE: '4(x2),3' -> [4, 4, 3] (one count per node, in node order)."""
    counts: list[int] = []
    for part in value.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise EnvError(
                f"SLURM_TASKS_PER_NODE={value!r} cannot be parsed",
                fix="expected Slurm's format such as '4(x2),3'; unset it to derive it from "
                "SLURM_NTASKS / SLURM_JOB_NUM_NODES.",
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _from_slurm(e: Mapping[str, str]) -> DistEnv:
    world = _int(e, "SLURM_NTASKS")
    nnodes = _int(e, "SLURM_JOB_NUM_NODES", _int(e, "SLURM_NNODES", 1))
    node_rank = _int(e, "SLURM_NODEID", 0)
    # SLURM_TASKS_PER_NODE ('4(x2),3') gives each node's count; nodes may differ.
    per_node = e.get("SLURM_TASKS_PER_NODE") or e.get("SLURM_NTASKS_PER_NODE")
    counts = slurm_tasks_per_node(per_node) if per_node else []
    if len(counts) == 1:
        counts = counts * nnodes
    local_world = counts[node_rank] if node_rank < len(counts) else max(1, world // nnodes)
    nodelist = e.get("SLURM_JOB_NODELIST") or e.get("SLURM_NODELIST") or ""
    master = e.get("MASTER_ADDR") or (
        first_slurm_host(nodelist) if nodelist else DEFAULT_MASTER_ADDR
    )
    return DistEnv(
        rank=_int(e, "SLURM_PROCID"),
        local_rank=_int(e, "SLURM_LOCALID"),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        nnodes=nnodes,
        master_addr=master,
        master_port=_int(e, "MASTER_PORT", DEFAULT_MASTER_PORT),
        source="slurm",
    )


def _from_mpi(e: Mapping[str, str]) -> DistEnv:
    world = _int(e, "OMPI_COMM_WORLD_SIZE")
    rank = _int(e, "OMPI_COMM_WORLD_RANK")
    local_world = _int(e, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    return DistEnv(
        rank=rank,
        local_rank=_int(e, "OMPI_COMM_WORLD_LOCAL_RANK", 0 if world == 1 else None),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(e, "OMPI_COMM_WORLD_NODE_RANK", rank // local_world),
        nnodes=max(1, world // local_world),
        master_addr=e.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=_int(e, "MASTER_PORT", DEFAULT_MASTER_PORT),
        source="mpi",
    )


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read this process's coordinates from the environment (``os.environ`` by default).

    A launcher's ``RANK``/``WORLD_SIZE`` win over Slurm's and MPI's variables, because
    ``srun rankwise run ...`` sets both and the launcher's describe the actual workers.
    A Slurm allocation that runs a single task (``SLURM_NTASKS=1``, e.g. an interactive
    ``salloc`` shell) is a single process, not a job to join.
    """
    e = os.environ if environ is None else environ
    if "RANK" in e or "WORLD_SIZE" in e:
        return _from_launcher(e)
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e and e.get("SLURM_NTASKS") != "1":
        return _from_slurm(e)
    if "OMPI_COMM_WORLD_RANK" in e:
        return _from_mpi(e)
    return DistEnv()


def export_for_torch(env: DistEnv) -> None:
    """Make torch's ``env://`` rendezvous see ``env`` (needed when it came from Slurm or MPI)."""
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )


def gloo_interface() -> str | None:
    """``GLOO_SOCKET_IFNAME``: the network interface Gloo uses, when the user chose one."""
    return os.environ.get("GLOO_SOCKET_IFNAME") or None


def default_gloo_interface(name: str) -> None:
    """Point Gloo (which reads ``GLOO_SOCKET_IFNAME`` itself) at ``name``, unless the user chose."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


def default_fresh_store_per_round() -> None:
    """``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torch's agent (unless the user chose): each
    c10d rendezvous round gets its own store, hosted by the new rank 0 (docs/launcher.md)."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def default_omp_threads(threads: int) -> None:
    """``OMP_NUM_THREADS`` for the workers this process starts, unless the user chose."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def set_rank_prefix_for_workers(prefixed: bool) -> None:
    """``RANKWISE_RANK_PREFIX``: the launcher prefixes workers' lines (``launcher_prefixes_output``)."""
    os.environ["RANKWISE_RANK_PREFIX"] = "1" if prefixed else "0"


def rank_prefix_env(prefixed: bool) -> dict[str, str]:
    """The variable ``set_rank_prefix_for_workers`` sets, for an ``env=`` mapping of workers
    started by ``rw.launch`` (which prefixes their lines itself)."""
    return {"RANKWISE_RANK_PREFIX": "1" if prefixed else "0"}


def set_collective_debug() -> None:
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` here and in the workers: torch checks every collective."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"


def set_launcher_pid_for_workers(pid: int) -> None:
    """``RANKWISE_LAUNCHER_PID`` for the workers: the bootstrap makes them die with it."""
    os.environ["RANKWISE_LAUNCHER_PID"] = str(pid)


def set_diag_dir_for_workers(folder: str, *, summary_quotes: bool = False) -> None:
    """``RANKWISE_DIAG_DIR`` (``diag_dir``), ``RANKWISE_SUMMARY_QUOTES`` (bootstrap) for workers."""
    os.environ["RANKWISE_DIAG_DIR"] = folder
    os.environ["RANKWISE_SUMMARY_QUOTES"] = "1" if summary_quotes else "0"


def fingerprints_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``RANKWISE_FINGERPRINTS`` is 0/off/false/no (collective fingerprints are on by default)."""
    e = os.environ if environ is None else environ
    return e.get("RANKWISE_FINGERPRINTS", "1").strip().lower() not in ("0", "off", "false", "no")


def diag_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """``RANKWISE_DIAG_DIR``: where each rank writes ``rank{r}.txt`` when it diagnoses a failure
    (the launcher sets it and puts those files in its summary)."""
    return (os.environ if environ is None else environ).get("RANKWISE_DIAG_DIR") or None


STALL_REPORT_S = 50.0
"""Default of ``RANKWISE_STALL_REPORT_S``."""


def stall_report_s(environ: Mapping[str, str] | None = None) -> float:
    """``RANKWISE_STALL_REPORT_S``: seconds a collective may wait before a stall report (0: off)."""
    raw = (os.environ if environ is None else environ).get("RANKWISE_STALL_REPORT_S", "").strip()
    try:
        value = float(raw) if raw else STALL_REPORT_S
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise EnvError(f"RANKWISE_STALL_REPORT_S={raw!r} is not a number of seconds >= 0",
                       fix="set it to e.g. 60 (report a collective waiting for a minute), or 0 "
                       "to turn stall reports off.")  # fmt: skip
    return value


def stall_waits(environ: Mapping[str, str] | None = None) -> bool:
    """``RANKWISE_ON_STALL``: 'end' (default: a stall report ends the job) or 'wait'."""
    raw = (os.environ if environ is None else environ).get("RANKWISE_ON_STALL", "").strip().lower()
    if raw in ("", "end", "wait"):
        return raw == "wait"
    raise EnvError(f"RANKWISE_ON_STALL={raw!r} is not 'end' or 'wait'", fix="set it to end (a "
                   "stall report ends the job) or wait (wait up to the timeout).")  # fmt: skip


def launcher_prefixes_output(environ: Mapping[str, str] | None = None) -> bool:
    """``RANKWISE_RANK_PREFIX=1``: the launcher prefixes every output line with the rank."""
    e = os.environ if environ is None else environ
    return e.get("RANKWISE_RANK_PREFIX") == "1"


def live_bars_env(live: bool) -> dict[str, str]:
    """``RANKWISE_LIVE_BARS`` for workers started by ``rw.launch``: 1 when the caller shows
    their carriage-return updates as one line redrawn in place (a terminal, a notebook)."""
    return {"RANKWISE_LIVE_BARS": "1" if live else "0"}


def parent_draws_bars(environ: Mapping[str, str] | None = None) -> bool:
    """``RANKWISE_LIVE_BARS=1``: this worker's bars may redraw in place (see ``live_bars_env``)."""
    e = os.environ if environ is None else environ
    return e.get("RANKWISE_LIVE_BARS") == "1"


def rdzv_token(environ: Mapping[str, str] | None = None) -> str | None:
    """``RANKWISE_RDZV_TOKEN``: the secret that signs a c10d rendezvous (``--rdzv-token``)."""
    e = os.environ if environ is None else environ
    return e.get("RANKWISE_RDZV_TOKEN") or None


def snapshot() -> dict[str, str]:
    """A copy of the whole environment (for checks such as ``rankwise doctor`` that take a mapping)."""
    return dict(os.environ)
