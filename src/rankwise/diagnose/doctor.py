"""``rankwise doctor``: check a machine and an environment before a job starts.

Each check returns findings (ok / info / warn / error), every problem with a fix. Checks take
the environment as a mapping, so they can be tested (and run for another machine's variables)
without touching ``os.environ``. Exit status: 1 when any error (or, with ``--strict``, any
warning) was found, else 0.

The command line (``rankwise doctor``, ``python -m rankwise doctor``) is in
``cli.py``; this module is the checks.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import EnvError
from ..job import env as envmod
from ..job import netif


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One result of one check."""

    check: str
    """Which check: torch, backends, gpus, env, network, port, threads."""
    status: str
    """'ok', 'info', 'warn' or 'error'."""
    message: str
    fix: str | None = None


def check_torch() -> list[Finding]:
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return [
            Finding(
                check="torch",
                status="error",
                message=f"torch {torch.__version__} was built without torch.distributed",
                fix="install a standard torch build (pip install torch).",
            )
        ]
    return [Finding(check="torch", status="ok", message=f"torch {torch.__version__}")]


def check_backends() -> list[Finding]:
    import torch.distributed as dist

    found = {name: dist.is_backend_available(name) for name in ("gloo", "nccl", "mpi")}
    text = "; ".join(f"{n}: {'available' if ok else 'not built'}" for n, ok in found.items())
    if not found["gloo"] and not found["nccl"]:
        return [
            Finding(
                check="backends",
                status="error",
                message=text,
                fix="install a torch build with gloo (every standard build has it).",
            )
        ]
    return [Finding(check="backends", status="ok", message=text)]


def check_gpus(nproc: int, gpus: int, environ: Mapping[str, str]) -> list[Finding]:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if gpus == 0:
        return [
            Finding(
                check="gpus",
                status="info",
                message=f"no CUDA GPU visible{shown}: {nproc} rank(s) will run on CPU with gloo",
            )
        ]
    if nproc > gpus:
        return [
            Finding(
                check="gpus",
                status="error",
                message=f"--nproc-per-node {nproc} but only {gpus} GPU(s) are visible{shown}: "
                "NCCL needs one GPU per rank",
                fix=f"use --nproc-per-node {gpus}, or make more GPUs visible (CUDA_VISIBLE_DEVICES).",
            )
        ]
    note = "" if nproc == gpus else f" ({gpus - nproc} left idle)"
    return [Finding(check="gpus", status="ok", message=f"{nproc} rank(s) on {gpus} GPU(s){note}")]


def check_env(environ: Mapping[str, str], nproc: int, nnodes: int) -> list[Finding]:
    """Launcher/Slurm/MPI variables that contradict each other or the flags."""
    try:
        e = envmod.detect(environ)
    except EnvError as exc:
        return [Finding(check="env", status="error", message=exc.message, fix=exc.fix)]
    out: list[Finding] = []
    port = environ.get("MASTER_PORT")
    if port is not None and not port.strip().isdigit():
        out.append(
            Finding(
                check="env",
                status="error",
                message=f"MASTER_PORT={port!r} is not a port number",
                fix="set MASTER_PORT to a free TCP port, e.g. 29500.",
            )
        )
    if e.source != "single" and e.world_size != nproc * nnodes:
        out.append(
            Finding(
                check="env",
                status="warn",
                message=f"WORLD_SIZE={e.world_size} (from {e.source}) but --nnodes {nnodes} x "
                f"--nproc-per-node {nproc} = {nproc * nnodes}",
                fix="these variables are left over from another job or launcher: unset them "
                "(unset RANK WORLD_SIZE LOCAL_RANK) or make the flags match.",
            )
        )
    slurm = environ.get("SLURM_NTASKS")
    if e.source == "launcher" and slurm and slurm.isdigit() and int(slurm) not in (1, e.world_size):
        out.append(
            Finding(
                check="env",
                status="warn",
                message=f"WORLD_SIZE={e.world_size} but SLURM_NTASKS={slurm}",
                fix="start one launcher per node (srun --ntasks-per-node=1 rankwise run ...) "
                "or let Slurm start every rank (srun --ntasks=N python train.py).",
            )
        )
    if not out:
        out.append(
            Finding(check="env", status="ok", message=f"environment consistent ({e.source})")
        )
    return out


def check_network(master: str, environ: Mapping[str, str]) -> list[Finding]:
    """The interface that reaches the master, and whether Gloo would bind to it."""
    if netif.is_loopback(master):
        return [
            Finding(
                check="network",
                status="ok",
                message=f"master {master} is this machine (single node)",
            )
        ]
    try:
        address = socket.gethostbyname(master)
    except OSError as exc:
        return [
            Finding(
                check="network",
                status="error",
                message=f"master address {master!r} does not resolve ({exc})",
                fix="use the master's IP address, or fix DNS / /etc/hosts.",
            )
        ]
    name = netif.interface_towards(address)
    if name is None:
        return [
            Finding(
                check="network",
                status="error",
                message=f"no route from this machine to {master} ({address})",
                fix="check the network (ip route get ADDRESS) and firewall between the nodes.",
            )
        ]
    reached = Finding(
        check="network",
        status="ok",
        message=f"{master} ({address}) is reached via interface {name}",
    )
    return [reached, *_gloo_binding(master, name, environ)]


def _gloo_binding(master: str, name: str, environ: Mapping[str, str]) -> list[Finding]:
    """Whether Gloo binds to ``name``, the interface that reaches the master."""
    chosen = environ.get("GLOO_SOCKET_IFNAME")
    if chosen:
        if chosen.split(",")[0] == name:
            return []
        return [
            Finding(
                check="network",
                status="warn",
                message=f"GLOO_SOCKET_IFNAME={chosen} but the route to {master} uses {name}",
                fix=f"export GLOO_SOCKET_IFNAME={name} (or unset it: rw.init picks it).",
            )
        ]
    host = socket.gethostname()
    try:
        own = socket.gethostbyname(host)
    except OSError:
        own = None
    if own is not None and not netif.is_loopback(own):
        if own == netif.interface_address(name) or netif.source_address_towards(own) != own:
            return []  # its address is on that interface (or not on this machine at all)
        return [
            Finding(
                check="network",
                status="warn",
                message=f"Gloo would bind to {own}: hostname {host!r} resolves to an address "
                f"of this machine that is not on {name}, the interface that reaches {master}",
                fix=f"export GLOO_SOCKET_IFNAME={name} (rw.init sets it for you; torchrun "
                "does not).",
            )
        ]
    return [
        Finding(
            check="network",
            status="warn",
            message=f"Gloo would bind to {own or 'nothing'}: hostname {host!r} resolves to "
            f"{own or 'no address'}, which the other nodes cannot reach",
            fix=f"export GLOO_SOCKET_IFNAME={name} (rw.init sets it for you; torchrun does not).",
        )
    ]


def _is_local(address: str) -> bool:
    return netif.is_loopback(address) or netif.source_address_towards(address) == address


def check_port(master: str, port: int, node_rank: int = 0, nnodes: int = 1) -> list[Finding]:
    """On the master's machine (node 0): is the port free for the rendezvous store?

    On another node, whether the master's address fits the node's rank: node 0 binds the
    port, every other node connects to it.
    """
    if not 0 <= node_rank < nnodes:
        return [
            Finding(
                check="port",
                status="error",
                message=f"--node-rank {node_rank} is out of range for --nnodes {nnodes}",
                fix=f"node ranks count from 0: give the nodes --node-rank 0 .. {nnodes - 1}.",
            )
        ]
    try:
        address = socket.gethostbyname(master)
    except OSError:
        return []  # reported by the network check
    local = _is_local(address)
    if node_rank > 0 or not local:
        return [_not_the_master(master, port, node_rank, nnodes, local)]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "busy"
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            why = (
                "is already in use" if exc.errno == errno.EADDRINUSE else "needs root (below 1024)"
            )
            return [
                Finding(
                    check="port",
                    status="error",
                    message=f"master port {port} on {master} {why}",
                    fix=f"pick another port (--master-port {_free_port()}), or find the process "
                    f"holding it: ss -ltnp 'sport = :{port}'.",
                )
            ]
    return [Finding(check="port", status="ok", message=f"master port {port} is free on {master}")]


def _not_the_master(master: str, port: int, node_rank: int, nnodes: int, local: bool) -> Finding:
    """The port check for a machine that does not bind the master port."""
    if local:  # node_rank > 0 yet the master is here: every node would be its own master
        return Finding(
            check="port",
            status="warn",
            message=f"--node-rank {node_rank} with master {master} on this machine: right only "
            "when node 0 runs here too (a test); other machines cannot reach it",
            fix="on a cluster pass --master-addr with node 0's address on every node.",
        )
    if node_rank == 0 and nnodes > 1:
        return Finding(
            check="port",
            status="warn",
            message=f"--node-rank 0 is the master's node but master {master} is another machine",
            fix=f"on node 0 pass its own address (--master-addr), or give this machine its "
            f"rank --node-rank 1 .. {nnodes - 1}.",
        )
    return Finding(
        check="port",
        status="info",
        message=f"master {master} is another machine: run doctor --node-rank 0 there to "
        f"check port {port}",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(nproc: int, environ: Mapping[str, str], cores: int) -> list[Finding]:
    """OMP threads x ranks on this machine against its cores."""
    raw = environ.get("OMP_NUM_THREADS")
    threads = int(raw) if raw and raw.strip().isdigit() and int(raw) > 0 else None
    per_rank = threads if threads is not None else cores
    total = per_rank * nproc
    fix = f"export OMP_NUM_THREADS={max(1, cores // nproc)} (cores / ranks per node)."
    if raw is None and nproc > 1:  # `rankwise run` (and torchrun) set it: not a problem
        return [
            Finding(
                check="threads",
                status="info",
                message=f"OMP_NUM_THREADS is unset: rankwise run and torchrun give each of "
                f"{nproc} workers 1 thread; started another way (srun, mpirun), each may start "
                f"{cores} threads ({total} on {cores} cores)",
                fix=fix,
            )
        ]
    if threads is None and nproc > 1:
        return [
            Finding(
                check="threads",
                status="warn",
                message=f"OMP_NUM_THREADS is {raw!r}, not a number of threads: each of {nproc} "
                f"ranks may start {cores} threads ({total} on {cores} cores)",
                fix=fix,
            )
        ]
    if total > cores:
        return [
            Finding(
                check="threads",
                status="warn",
                message=f"OMP_NUM_THREADS={threads} x {nproc} ranks = {total} threads on {cores} "
                "cores: oversubscribed, every rank slows down",
                fix=fix,
            )
        ]
    return [Finding(check="threads", status="ok", message=f"{total} thread(s) for {cores} core(s)")]


def run_checks(
    *,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    environ: Mapping[str, str] | None = None,
    gpus: int | None = None,
    cores: int | None = None,
) -> list[Finding]:
    """Every check, in order. ``environ``/``gpus``/``cores`` default to this machine's."""
    environ = envmod.snapshot() if environ is None else environ
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    master = master_addr or environ.get("MASTER_ADDR") or envmod.DEFAULT_MASTER_ADDR
    raw_port = environ.get("MASTER_PORT", "")
    port = master_port or (int(raw_port) if raw_port.isdigit() else envmod.DEFAULT_MASTER_PORT)
    return [
        *check_torch(),
        *check_backends(),
        *check_gpus(nproc_per_node, gpus, environ),
        *check_env(environ, nproc_per_node, nnodes),
        *check_network(master, environ),
        *check_port(master, port, node_rank, nnodes),
        *check_threads(nproc_per_node, environ, cores or _cores()),
    ]


def format_text(findings: Sequence[Finding]) -> str:
    errors = sum(f.status == "error" for f in findings)
    warns = sum(f.status == "warn" for f in findings)
    lines = [f"rankwise doctor: {errors} error(s), {warns} warning(s)"]
    for f in findings:
        lines.append(f"  {f.status:<5}  {f.check:<8}  {f.message}")
        if f.fix:
            lines.append(f"  {'':<5}  {'':<8}  fix: {f.fix}")
    return "\n".join(lines)


if __name__ == "__main__":  # the command is ``rankwise doctor``; importing cli.py here would
    # be an import circle (cli.py imports this module), so point at it instead
    sys.exit("rankwise doctor is the command: python -m rankwise doctor [--json] ...")
