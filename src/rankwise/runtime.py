"""``rw.init()``: join the job (or not, at world size 1), choose device and backend, once.

One process group per process is torch's rule ("trying to initialize the default process group
twice!"). ``init()`` therefore keeps the runtime it made and returns it again on a second call;
a second call that asks for something else (another backend, another device) is refused with
both values named, instead of torch's error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import env as envmod
from . import netif
from .env import DistEnv
from .errors import ConfigError, DistributedError, RuntimeStateError

DEFAULT_TIMEOUT_S = 300.0
"""Finite default for every collective and the rendezvous: a hang becomes an error."""

_BACKENDS = ("gloo", "nccl", "mpi")


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """This process's place in the job and the resources it uses."""

    env: DistEnv
    """Rank, local rank, world size and where they came from."""
    device: torch.device
    """The device this process computes on: ``cuda:local_rank`` on GPU machines, else CPU."""
    backend: str | None
    """The torch.distributed backend ('nccl', 'gloo', ...); None at world size 1."""
    timeout: timedelta
    """Timeout of the rendezvous and of every collective."""
    owns_process_group: bool = field(default=False, repr=False)
    """True when ``init`` created the process group (and ``shutdown`` should destroy it)."""
    strategy: str = "single"
    """How ``prepare`` parallelises: 'single', 'dp' (DataParallel) or 'ddp' ('auto' resolved)."""
    devices: tuple[torch.device, ...] = ()
    """The devices this process computes on: DataParallel's under 'dp', else ``(device,)``."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_master(self) -> bool:
        return self.env.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is active."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    # The one-call API; the logic lives in the session package (strategy, model, loader).

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loader: Any = None,
        *,
        global_batch_size: int | None = None,
    ) -> Any:
        """Move, then wrap the model for ``strategy``; split the loader; see ``session.prepare``.

        Sync point: all ranks under 'ddp'.
        """
        from . import session

        return session.prepare(self, model, optimizer, loader, global_batch_size=global_batch_size)

    def prepare_loader(
        self, loader: Any, *, global_batch_size: int | None = None, evaluation: bool = False
    ) -> Any:
        """A loader split over the replicas, batches on the device; ``evaluation``: each sample
        once. No sync point."""
        from . import session

        return session.prepare_loader(
            self, loader, global_batch_size=global_batch_size, evaluation=evaluation
        )

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (``rw.print0``)."""
        from .log import print0

        print0(*args, **kwargs)

    def save(self, path: str | Path, **kwargs: Any) -> Path:
        """``rw.save_checkpoint``: rank 0 writes. Sync point: all ranks (call it on every rank)."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(path, **kwargs)

    def load(self, path: str | Path, **kwargs: Any) -> dict[str, Any]:
        """``rw.load_checkpoint``, mapped to this process's device. No sync point."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(path, **kwargs)


# The process group is process-global state in torch; this mirrors it, nothing more.
_current: Runtime | None = None
joined_a_group = False
"""True once ``init`` joined a process group in this process (kept after ``shutdown``)."""


def _as_timeout(timeout: float | timedelta | None) -> timedelta:
    if timeout is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds <= 0:
        raise ConfigError(
            f"timeout={timeout!r} must be positive",
            fix="pass a timeout in seconds, e.g. rw.init(timeout=300).",
        )
    return timedelta(seconds=seconds)


def choose_device(env: DistEnv, device: str | torch.device | None = None) -> torch.device:
    """``cuda:local_rank`` when CUDA is available, else CPU; an explicit ``device`` wins."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", env.local_rank)
    elif torch.cuda.is_available():
        dev = torch.device("cuda", env.local_rank)
    else:
        return torch.device("cpu")
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index >= count:
            raise ConfigError(
                f"local rank {env.local_rank} needs {dev} but this node has {count} GPU(s) "
                f"for LOCAL_WORLD_SIZE={env.local_world_size} processes",
                fix=f"start at most {count} process(es) per node (--nproc-per-node {count}), "
                "or check CUDA_VISIBLE_DEVICES.",
                rank=env.rank,
            )
    return dev


def choose_backend(device: torch.device, backend: str | None = None) -> str:
    """nccl for CUDA devices, gloo otherwise; an explicit ``backend`` wins if available."""
    if backend is None:
        backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    base = [part.split(":")[-1] for part in backend.split(",")]
    for name in base:
        if name not in _BACKENDS:
            raise ConfigError(
                f"backend={backend!r} is not one of {', '.join(_BACKENDS)}",
                fix="use 'nccl' for GPUs and 'gloo' for CPUs, or leave backend unset.",
            )
        if not dist.is_backend_available(name):
            raise ConfigError(
                f"backend={name!r} is not available in this torch build",
                fix="use 'gloo' (always built) or install a torch build with this backend.",
            )
    return backend


def _pick_gloo_interface(env: DistEnv, backend: str) -> None:
    if "gloo" not in backend or envmod.get("GLOO_SOCKET_IFNAME"):
        return
    if netif.is_loopback(env.master_addr):
        return
    name = netif.interface_towards(env.master_addr)
    if name is not None:
        envmod.set_default("GLOO_SOCKET_IFNAME", name)


def _check_same(current: Runtime, backend: str | None, device, timeout) -> None:
    asked = {
        "backend": None if backend is None else backend,
        "device": None if device is None else torch.device(device),
        "timeout": None if timeout is None else _as_timeout(timeout),
    }
    have = {"backend": current.backend, "device": current.device, "timeout": current.timeout}
    for key, value in asked.items():
        if value is None or value == have[key] or have[key] is None:
            continue
        if key == "device" and value.type == have[key].type and value.index is None:
            continue
        raise RuntimeStateError(
            f"rw.init() was already called with {key}={have[key]!s}; "
            f"this call asks for {key}={value!s}",
            fix="call rw.init() once at the start of the program (later calls return the same "
            "runtime), or rw.shutdown() first to start over with other settings.",
            rank=current.rank,
        )


def _adopt_existing(env: DistEnv, device, timeout: timedelta) -> Runtime:
    """The user (or another library) already called ``init_process_group``: use it."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    if (world, rank) != (env.world_size, env.rank):
        env = DistEnv(
            rank=rank,
            world_size=world,
            local_rank=min(env.local_rank, world - 1),
            local_world_size=min(env.local_world_size, world),
            master_addr=env.master_addr,
            master_port=env.master_port,
            source=env.source,
        )
    dev = choose_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return Runtime(env=env, device=dev, backend=str(dist.get_backend()), timeout=timeout)


def init(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: float | timedelta | None = None,
    env: DistEnv | None = None,
    strategy: str | None = None,
    devices: Sequence[Any] | None = None,
) -> Runtime:
    """Join the distributed job described by the environment, or run as a single process.

    Idempotent: a second call returns the same runtime. Works unlaunched (``python train.py``)
    as world size 1, where no process group is created and every collective is a no-op.
    ``strategy`` ('auto', 'single', 'dp', 'ddp') and ``devices`` (DataParallel's) decide what
    ``rt.prepare`` does; 'auto' (the default) is 'ddp' when launched, 'dp' over every GPU
    when unlaunched with several, else 'single'.

    Sync point: all ranks (the rendezvous), when world size > 1.
    """
    global _current
    from . import session

    if _current is not None:
        _check_same(_current, backend, device, timeout)
        session.check_same(_current, strategy, devices)
        return _current
    explicit_env = env is not None
    env = envmod.detect() if env is None else env
    timeout_td = _as_timeout(timeout)
    if dist.is_available() and dist.is_initialized():
        rt = _adopt_existing(env, device, timeout_td)
        _current = _with_plan(rt, session.plan(strategy, devices, rt.env, device))
        return _current
    # Settled before the rendezvous: a refused strategy fails every rank at once.
    the_plan = session.plan(strategy, devices, env, device)
    if the_plan.devices:
        device = the_plan.devices[0]
    dev = choose_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if env.world_size == 1:
        rt = Runtime(env=env, device=dev, backend=None, timeout=timeout_td)
        _current = _with_plan(rt, the_plan)
        return _current
    chosen = choose_backend(dev, backend)
    _pick_gloo_interface(env, chosen)
    # torch's env:// reads RANK/MASTER_* itself: give it the values we were given or detected.
    if explicit_env or env.source in ("slurm", "mpi"):
        envmod.export_for_torch(env)
    try:
        dist.init_process_group(
            backend=chosen,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout_td,
            **_rendezvous(env, timeout_td),
        )
    except (RuntimeError, ValueError) as exc:  # DistStoreError is a RuntimeError
        raise DistributedError(
            f"could not join the job at MASTER_ADDR={env.master_addr} "
            f"MASTER_PORT={env.master_port} as rank {env.rank} of {env.world_size} "
            f"within {timeout_td.total_seconds():.0f}s ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
            fix="check that rank 0 is running and that MASTER_ADDR/MASTER_PORT reach it "
            "from this machine (`rankwise doctor`), or raise the timeout.",
            rank=env.rank,
        ) from exc
    global joined_a_group
    joined_a_group = True  # the launcher's bootstrap reads it to tell a lone copy (docs/launcher.md)
    rt = Runtime(env=env, device=dev, backend=chosen, timeout=timeout_td, owns_process_group=True)
    _current = _with_plan(rt, the_plan)
    return _current


def _rendezvous(env: DistEnv, timeout: timedelta) -> dict:
    """How ``init_process_group`` finds its peers: torch's ``env://``, with one exception.

    Under the launcher's agent the store outlives a restart of the worker group. The keys the
    previous attempt's ranks left in it (their Gloo addresses among them) would be read as
    the new ranks' and the connection refused; a prefix per attempt keeps attempts apart.
    """
    if not env.agent_store:
        return {"init_method": "env://"}
    store = dist.TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout
    )
    return {"store": dist.PrefixStore(f"/rankwise/attempt_{env.restart_count}", store)}


def _with_plan(rt: Runtime, plan: Any) -> Runtime:
    return dataclasses.replace(rt, strategy=plan.strategy, devices=plan.devices or (rt.device,))


def get_runtime() -> Runtime:
    """The runtime made by ``init()``; an error (with the fix) before ``init()``."""
    if _current is None:
        raise RuntimeStateError(
            "rankwise is not initialised in this process",
            fix="call `rt = rw.init()` at the start of the program.",
        )
    return _current


def is_initialized() -> bool:
    """True after ``init()`` and before ``shutdown()``."""
    return _current is not None


def shutdown() -> None:
    """Leave the job: destroy the process group ``init`` created. Safe to call twice.

    Sync point: none (torch's destroy is local), but call it on every rank at the end.
    """
    global _current
    if _current is not None and _current.owns_process_group and dist.is_initialized():
        from .diagnose import fingerprints

        fingerprints.reset()  # its watchdog talks to the store the group is about to drop
        dist.destroy_process_group()
    _current = None
