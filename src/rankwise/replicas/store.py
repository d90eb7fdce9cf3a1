"""The host's replica folder: a per-host, per-job folder in tmpfs (RAM) that outlives the worker
processes (torch's elastic agent restarts them all on a membership change) but not the host.

Default: ``/dev/shm/rankwise-replicas/<run id>/<host name>``; ``RANKWISE_REPLICA_DIR`` moves the
root, ``RANKWISE_REPLICA_HOST`` names the host (hosts that share one ``/dev/shm``, as the
namespace test cluster's do, each get their own folder). A file is
``r<rank>-s<step>-w<world>.rwr``, written to a temporary name and renamed, so a listed file is
whole. A rank reads only its own host's folder: what another host holds comes over
collectives (``exchange.py``), never through a shared filesystem.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

import torch

from ..job import env
from .plan import Held

NAME = re.compile(r"^r(\d+)-s(\d+)-w(\d+)\.rwr$")
DEFAULT_ROOT = "/dev/shm/rankwise-replicas"


def host_name() -> str:
    """This host's key: ``RANKWISE_REPLICA_HOST`` or the host name."""
    return env.snapshot().get("RANKWISE_REPLICA_HOST") or socket.gethostname()


def default_folder() -> Path:
    """``<root>/<run id>/<host>``: the run id is the elastic agent's, the same across restarts."""
    e = env.snapshot()
    root = e.get("RANKWISE_REPLICA_DIR") or DEFAULT_ROOT
    run = re.sub(r"[^A-Za-z0-9_.-]", "_", e.get("TORCHELASTIC_RUN_ID") or "none")
    return Path(root) / run / re.sub(r"[^A-Za-z0-9_.-]", "_", host_name())


def path_of(folder: Path, held: Held) -> Path:
    return folder / f"r{held.rank}-s{held.step}-w{held.world}.rwr"


def write(folder: Path, held: Held, buf: torch.Tensor) -> None:
    """Write ``buf`` as ``held``'s file, whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    target = path_of(folder, held)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(buf.numpy()))
    os.replace(tmp, target)


def listing(folder: Path) -> list[Held]:
    """Every whole replica in ``folder`` (none when it does not exist)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = NAME.match(name)
        if m:
            out.append(Held(int(m[1]), int(m[2]), int(m[3])))
    return sorted(out, key=lambda h: (h.step, h.world, h.rank))


def read(folder: Path, held: Held) -> torch.Tensor:
    data = path_of(folder, held).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)


def prune(folder: Path, keep_from: int) -> None:
    """Delete the replicas of steps before ``keep_from``."""
    for held in listing(folder):
        if held.step < keep_from:
            path_of(folder, held).unlink(missing_ok=True)


def remove(folder: Path) -> None:
    """Delete the host's folder, then its run's and the root when they are left empty."""
    shutil.rmtree(folder, ignore_errors=True)
    for parent in (folder.parent, folder.parent.parent):
        try:
            parent.rmdir()
        except OSError:
            return  # not empty (another host's, another job's), or not ours
