"""``rw.init()``: join the job (or not, at world size 1), choose device, backend and plan, once.

The ground floor of rankwise: it imports only ``env``, ``process_group``, ``devices``, ``plan``,
``strategies`` and ``errors``, never anything above it (``comm``, engines, ``session``). Layers above that must act
when the process group goes away (the fingerprints' watchdog) register with ``on_shutdown``.

One process group per process is torch's rule ("trying to initialize the default process group
twice!"). ``init()`` therefore keeps the runtime it made and returns it again on a second call;
a second call that asks for something else (another backend, another device) is refused with
both values named, instead of torch's error.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import ConfigError, EnvError, RuntimeStateError
from .job import env as envmod
from .job import mesh as meshmod
from .job import process_group
from .job.env import DEFAULT_TIMEOUT_S, DistEnv
from .job.mesh import DeviceMesh
from .job.plan import (
    BACKENDS,
    Plan,
    Precision,
    as_timeout,
    check_same,
    check_same_precision,
    check_same_settings,
    plan,
)
from .job.plan import parse as parse_precision
from .strategies import Strategy
from .strategies import get as get_strategy

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Coords",
    "Runtime",
    "choose_backend",
    "choose_device",
    "coords",
    "get_runtime",
    "init",
    "is_initialized",
    "on_shutdown",
    "settle_strategy",
    "shutdown",
]

_BACKENDS = BACKENDS


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
    """How ``prepare`` parallelises: a name of ``rankwise.strategies.STRATEGIES`` ('auto'
    resolved; ``strategy_spec`` is its ``Strategy``)."""
    auto: bool = False
    """True while 'auto' may still change ``strategy`` (from 'ddp' to a ZeRO stage) at the
    first ``rt.prepare`` that sees a model and its optimizer (``settle_strategy``)."""
    devices: tuple[torch.device, ...] = ()
    """The devices this process computes on: DataParallel's under 'dp', else ``(device,)``."""
    precision: str = "32"
    """'32', 'bf16-mixed', 'fp16-mixed' or 'bf16-true': how ``prepare``'s model computes."""
    mesh: DeviceMesh | None = None
    """``rw.init(mesh=...)``'s device mesh with its groups (``rt.mesh.group("tensor")``);
    ``prepare``'s engines average over its data groups, the loader splits over them."""

    @property
    def strategy_spec(self) -> Strategy:
        """What ``strategy`` is: processes or threads, engine, shards, batch meaning, ..."""
        return get_strategy(self.strategy)

    @property
    def precision_policy(self) -> Precision:
        return parse_precision(self.precision)

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

    @property
    def replicas_in_process(self) -> int:
        """Model replicas this process computes: DataParallel's devices under 'dp', else 1."""
        return len(self.devices) if self.strategy_spec.splits_batch_in_process else 1


R = TypeVar("R", bound=Runtime)

# The process group is process-global state in torch; this mirrors it, nothing more.
_current: Runtime | None = None
_shutdown_hooks: list[Callable[[], None]] = []
_leave_hooks: list[Callable[[], None]] = []  # on_shutdown(always=True): world size 1 too


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
                ("" if device is None else f"device={device!r}: ")
                + f"local rank {env.local_rank} needs {dev} but this node has {count} GPU(s) "
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


def _adopt_existing(env: DistEnv, device, timeout: timedelta, kind: type[R], asked: bool) -> R:
    """The user already called ``init_process_group``: use it (``asked``: ``timeout`` too)."""
    process_group.adopt_timeout(timeout if asked else None)
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
    return kind(env=env, device=dev, backend=str(dist.get_backend()), timeout=timeout)


def init(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: float | timedelta | None = None,
    env: DistEnv | None = None,
    strategy: str | None = None,
    devices: Sequence[Any] | None = None,
    precision: str | None = None,
    mesh: Mapping[str, int] | None = None,
    debug: bool = False,
    kind: type[R] = Runtime,  # type: ignore[assignment]
) -> R:
    """Join the distributed job described by the environment, or run as a single process.

    Idempotent: a second call returns the same runtime. Works unlaunched (``python train.py``)
    as world size 1, where no process group is created and every collective is a no-op.
    ``strategy`` (a name of ``rankwise.strategies``; 'auto' by default) and ``devices``
    (DataParallel's) decide what ``rt.prepare`` does. ``precision`` ('32', 'bf16-mixed',
    'fp16-mixed', 'bf16-true'): how the prepared model computes (``rankwise.training.precision``).
    ``mesh`` (``{"data": 2, "tensor": 2}``, product = world size): ``rt.mesh``, its groups
    made right after the process group (docs/model-parallel.md). ``kind``: the runtime's
    class (``rw.init`` asks for a ``Session``). ``debug=True``: torch checks every collective
    across ranks before it runs (slower; docs/diagnose.md).

    Sync point: all ranks (the rendezvous and the mesh's groups), when world size > 1.
    """
    global _current
    if _current is not None:
        return _again(kind, backend, device, timeout, strategy, devices, precision, mesh)
    policy = parse_precision(precision)  # a bad name fails every rank before the rendezvous
    explicit_env = env is not None
    env = envmod.detect() if env is None else env
    timeout_td = as_timeout(timeout)
    if dist.is_available() and dist.is_initialized():
        rt = _adopt_existing(env, device, timeout_td, kind, timeout is not None)
        the_plan, grid = plan(strategy, devices, rt.env, device), _layout(mesh, rt.env)
        _current = _with_plan(rt, the_plan, policy, grid)
        return _current
    # Settled before the rendezvous: a refused strategy or mesh fails every rank at once.
    the_plan, grid = plan(strategy, devices, env, device), _layout(mesh, env)
    dev = choose_device(env, the_plan.devices[0] if the_plan.devices else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    chosen, owns = None, env.world_size > 1
    if owns:
        chosen = _join(env, choose_backend(dev, backend), timeout_td, explicit_env, debug)
    rt = kind(env=env, device=dev, backend=chosen, timeout=timeout_td, owns_process_group=owns)
    _current = _with_plan(rt, the_plan, policy, grid)
    return _current


def _layout(sizes: Mapping[str, int] | None, env: DistEnv) -> DeviceMesh | None:
    return None if sizes is None else meshmod.layout(sizes, env.world_size, env.rank)


def _join(env: DistEnv, backend: str, timeout: timedelta, exported: bool, debug: bool) -> str:
    """Create the process group. Sync point: all ranks (the rendezvous)."""
    process_group.create(env, backend, timeout, exported=exported, debug=debug)
    if "gloo" in backend:
        atexit.register(_shutdown_at_exit)
    return backend


def _again(kind: type[R], backend, device, timeout, strategy, devices, precision, mesh) -> R:
    """A second ``init``: the same runtime, unless it asks for something else (refused)."""
    global _current
    meshmod.check_same(_current.mesh, mesh, _current.rank)
    check_same_settings(_current, backend, device, timeout)
    have = Plan(strategy=_current.strategy, devices=_current.devices)
    check_same(have, _current.env, strategy, devices)
    check_same_precision(_current, precision)
    if not isinstance(_current, kind):  # made by a lower layer; same data, richer class
        have = dataclasses.fields(_current)
        _current = kind(**{f.name: getattr(_current, f.name) for f in have if f.init})
    return _current  # type: ignore[return-value]


def _with_plan(rt: R, settled: Plan, policy: Precision, grid: DeviceMesh | None) -> R:
    """``rt`` with its plan, precision and mesh (whose groups are made here: sync point,
    all ranks, when the world size is > 1)."""
    grid = grid and meshmod.create_groups(grid)
    devices = settled.devices or (rt.device,)
    return dataclasses.replace(
        rt, strategy=settled.strategy, auto=settled.auto, devices=devices,
        precision=policy.name, mesh=grid,
    )  # fmt: skip


def settle_strategy(rt: Runtime, name: str) -> None:
    """Fix 'auto''s choice for good: ``rt.strategy = name``, ``rt.auto = False``.

    The one change a runtime sees after ``init``: 'auto' cannot know whether a model fits one
    device until ``rt.prepare`` sees it, and the user holds ``rt`` (as does ``get_runtime``),
    so the choice is written into that object, once, before anything is wrapped. The caller
    decides ``name`` identically on every rank (``rankwise.session.auto``). No sync point.
    """
    get_strategy(name)  # a name outside the registry is a bug in the caller: fail here
    for held in {id(rt): rt, id(_current): _current}.values():
        if held is not None and held.env == rt.env:
            object.__setattr__(held, "strategy", name)  # frozen for users; settled here only
            object.__setattr__(held, "auto", False)


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


def on_shutdown(hook: Callable[[], None], *, always: bool = False, first: bool = False) -> None:
    """Call ``hook`` in ``shutdown()`` before the process group is destroyed (once per hook),
    in registration order; ``always``: whenever a runtime is left, world size 1 too
    (``rt.log``'s trackers); ``first``: before the hooks registered so far (a background save
    must end before the fingerprints stop recording its collectives). For layers above this
    one that hold on to the group (the fingerprints' watchdog talks to its store): they
    register here, so that this module never imports them."""
    hooks = _leave_hooks if always else _shutdown_hooks
    if hook not in hooks:
        hooks.insert(0, hook) if first else hooks.append(hook)


def shutdown() -> None:
    """Leave the job: destroy the process group ``init`` created. Safe to call twice.

    Sync point: none (torch's destroy is local), but call it on every rank at the end.
    """
    global _current
    for hook in _leave_hooks if _current is not None else ():
        hook()
    if _current is not None and _current.owns_process_group and dist.is_initialized():
        for hook in _shutdown_hooks:
            hook()
        process_group.destroy()
    _current = None


def _shutdown_at_exit() -> None:
    # Gloo's worker threads hold tensors of finished async work; left to the interpreter's
    # teardown they are freed without the GIL and the process dies of SIGABRT ("terminate
    # called without an active exception"). Leave the group while the interpreter is alive,
    # on a clean exit only: after an unhandled exception a collective may still be pending,
    # and waiting for it could hang (the launcher stops the job instead).
    if getattr(sys, "last_value", None) is None:
        with contextlib.suppress(Exception):  # never raise from atexit
            shutdown()


@dataclass(frozen=True)
class Coords:
    """Where this process sits, from the one lookup every module uses (``coords()``)."""

    rank: int
    world_size: int
    replicas_in_process: int = 1
    """Model replicas this process computes (DataParallel's devices under 'dp')."""
    source: str = "single"
    """'runtime', 'torch' (a process group made without ``rw.init``) or the environment's
    source ('launcher', 'slurm', 'mpi', 'single')."""
    data: tuple[int, int] | None = None
    """Under ``rw.init(mesh=...)``: (coordinate, size) along the data dimension, the share of
    the data this process reads (tensor and pipeline peers read the same); else None."""
    node: int = 0  # this process's machine, as the launcher says (GROUP_RANK, SLURM_NODEID...)


def coords() -> Coords:
    """Rank, world size and node of this process: the runtime's, else torch's process group's,
    else the launcher's environment (a loader built before ``rw.init()`` still splits the data).
    The one place that decides which source wins. No sync point."""
    if _current is not None:
        grid = _current.mesh
        data = None if grid is None else (grid.coord("data"), grid.sizes["data"])
        return Coords(_current.rank, _current.world_size, _current.replicas_in_process, "runtime",
                      data, _current.env.node_rank)  # fmt: skip
    if dist.is_available() and dist.is_initialized():
        where = (dist.get_rank(), dist.get_world_size())
        with contextlib.suppress(EnvError):  # a group made by hand: launcher variables partial
            return Coords(*where, source="torch", node=envmod.detect().node_rank)
        return Coords(*where, source="torch")
    e = envmod.detect()
    return Coords(e.rank, e.world_size, source=e.source, node=e.node_rank)


def data_group() -> Any:
    """The group that metrics reduce and gather over: under ``rw.init(mesh=...)`` with tensor
    or pipeline peers (which read the same batch: counted once, not once per peer), this rank's
    data group; else None (every rank). No sync point."""
    grid = None if _current is None else _current.mesh
    if grid is None or grid.world_size == grid.sizes["data"]:
        return None
    return grid.group("data")
