"""The one-call API: ``rt = rw.init(strategy=...)``, then ``rt.prepare(model, optimizer, loader)``.

The same training loop runs on one device, with DataParallel or with DDP by changing one word:

    rt = rw.init(strategy="auto")          # "single", "dp" or "ddp"
    model, opt, loader = rt.prepare(model, opt, loader)
    for x, y in loader:                    # batches arrive on the right device
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()

``prepare`` does, in the order the seed's pitfalls require: refuse a model that is already
wrapped; move the model to its device, then wrap it (pitfall 1); move optimizer state that was
created elsewhere; rebuild a plain ``DataLoader`` as ``rw.loader`` with our distributed sampler
(pitfall 3), keeping its batch size with the meaning torch gives it under that strategy, said
once in the log (pitfall 4). Printing and saving go through ``rt.print``/``rt.save``, which are
rank-aware (pitfalls 5 and 6).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from .data import Loader
from .data import loader as make_loader
from .env import DistEnv
from .errors import ConfigError, RuntimeStateError

if TYPE_CHECKING:
    from .runtime import Runtime

STRATEGIES = ("auto", "single", "dp", "ddp")
_LAUNCHER_FIX = (
    "use strategy='ddp' (or 'auto') when launched with several processes, or start the script "
    "with plain `python train.py` for one process."
)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What ``rw.init`` settles before it joins the job."""

    strategy: str
    """'single', 'dp' or 'ddp' ('auto' resolved)."""
    devices: tuple[torch.device, ...] = ()
    """DataParallel's devices under 'dp' (the first is the master); empty otherwise."""


def _accelerator_count() -> int:
    acc = torch.accelerator.current_accelerator()
    return torch.accelerator.device_count() if acc is not None else 0


def plan(strategy: str | None, devices: Sequence[Any] | None, env: DistEnv, device: Any) -> Plan:
    """Resolve ``strategy`` ('auto' included) for this process; errors say the fix.

    'auto': launched with world size > 1 -> 'ddp'; unlaunched with ``devices=`` or several
    GPUs (and no explicit ``device=``) -> 'dp'; otherwise 'single'. No sync point.
    """
    name = "auto" if strategy is None else strategy
    if name not in STRATEGIES:
        raise ConfigError(
            f"strategy={strategy!r} is not one of {', '.join(map(repr, STRATEGIES))}",
            fix="pass strategy='auto' (ddp when launched, dp on several GPUs, else single), "
            "or name one of 'single', 'dp', 'ddp'.",
        )
    if devices is not None and name in ("single", "ddp"):
        raise ConfigError(
            f"devices={list(devices)!r} lists DataParallel's devices, but strategy={name!r} "
            "computes on one device per process (rt.device)",
            fix="drop devices=, or use strategy='dp' to split each batch over those devices.",
        )
    if name == "auto":
        if env.world_size > 1:
            name = "ddp" if devices is None else "dp"
        elif devices is not None or (device is None and _accelerator_count() > 1):
            name = "dp"
        else:
            name = "single"
    if name in ("single", "dp") and env.world_size > 1:
        raise ConfigError(
            f"strategy={name!r} runs one process, but this process is rank {env.rank} of "
            f"WORLD_SIZE={env.world_size} (from {env.source})",
            fix=_LAUNCHER_FIX,
            rank=env.rank,
        )
    if name != "dp":
        return Plan(strategy=name)
    return Plan(strategy="dp", devices=_dp_devices(devices, device))


def _dp_devices(devices: Sequence[Any] | None, device: Any) -> tuple[torch.device, ...]:
    from .parallel.data_parallel import resolve_device

    if devices is None:
        count = _accelerator_count()
        if count == 0:
            raise ConfigError(
                "strategy='dp' was asked for on a machine without GPUs, and devices= was not given",
                fix="pass devices=['cpu', 'cpu'] for two CPU replicas (threads in this process), "
                "or use strategy='single'.",
            )
        acc = torch.accelerator.current_accelerator()
        devices = [torch.device(acc.type, i) for i in range(count)]
    if isinstance(devices, (str, int, torch.device)) or len(devices) == 0:
        raise ConfigError(
            f"devices={devices!r} must be a non-empty list of devices",
            fix="pass e.g. devices=[0, 1] or devices=['cpu', 'cpu'].",
        )
    resolved = tuple(resolve_device(d, f"devices[{i}]") for i, d in enumerate(devices))
    if device is not None and resolve_device(device, "device") != resolved[0]:
        raise ConfigError(
            f"device={device!r} differs from devices[0]={devices[0]!r}, DataParallel's master",
            fix="drop device= (strategy='dp' computes on devices[0]), or list it first in devices.",
        )
    return resolved


def check_same(current: Runtime, strategy: str | None, devices: Sequence[Any] | None) -> None:
    """A second ``rw.init`` may repeat the strategy (or say 'auto'), not ask for another one."""
    if strategy in (None, "auto") and devices is None:
        return
    if devices is None:  # a named strategy: compare names ('dp' alone means "the same devices")
        if strategy not in STRATEGIES:
            plan(strategy, None, current.env, None)  # raises the bad-name error
        asked = Plan(strategy=strategy)
    else:
        asked = plan(strategy, devices, current.env, None)
    if asked.strategy != current.strategy:
        key, have, want = "strategy", current.strategy, asked.strategy
    elif devices is not None and asked.devices != current.devices:
        key, have, want = "devices", _names(current.devices), _names(asked.devices)
    else:
        return
    raise RuntimeStateError(
        f"rw.init() was already called with {key}={have}; this call asks for {key}={want}",
        fix="call rw.init() once at the start of the program (later calls return the same "
        "runtime), or rw.shutdown() first to start over with other settings.",
        rank=current.rank,
    )


def _names(devices: Sequence[torch.device]) -> str:
    return "[" + ", ".join(f"'{d}'" for d in devices) + "]"


# -- the model ---------------------------------------------------------------------------------


def _wrapper_types() -> tuple[type, ...]:
    from .parallel import DataParallel, DistributedDataParallel
    from .pipeline import DistributedPipeline

    return (
        DataParallel,
        DistributedDataParallel,
        DistributedPipeline,
        nn.DataParallel,
        nn.parallel.DistributedDataParallel,
    )


def _refuse_wrapped(rt: Runtime, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"rt.prepare() got model={type(model).__name__}, not a torch.nn.Module",
            fix="pass the model first: rt.prepare(model, optimizer, loader).",
        )
    if isinstance(model, _wrapper_types()):
        cls = type(model)
        raise ConfigError(
            f"rt.prepare() got a model already wrapped in {cls.__module__}.{cls.__qualname__}; "
            f"strategy={rt.strategy!r} wraps the model itself",
            fix="pass the bare model: rt.prepare(model.module, ...) (or build the model and "
            "call rt.prepare before wrapping it yourself).",
            rank=rt.rank,
        )


def _spans_devices(model: nn.Module) -> bool:
    """True for a model split over devices (``rw.split``, hand-placed layers): left in place."""
    from .pipeline import Pipe

    found = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    return isinstance(model, Pipe) or len(found) > 1


def prepare_model(rt: Runtime, model: nn.Module) -> nn.Module:
    """Move ``model`` to ``rt.device``, then wrap it for ``rt.strategy``.

    Sync point: all ranks under 'ddp' (the wrapper broadcasts rank 0's parameters).
    """
    _refuse_wrapped(rt, model)
    spans = _spans_devices(model)
    if spans and rt.strategy == "dp":
        raise ConfigError(
            "strategy='dp' cannot wrap a model split over several devices: DataParallel "
            "copies the whole model to every device",
            fix="use strategy='ddp' (rankwise run --nproc-per-node N) for data parallelism on "
            "top of a split model, or strategy='single'.",
        )
    if not spans:
        model.to(rt.device)  # pitfall 1: move first, then wrap
    return wrap(rt, model, spans)


def wrap(rt: Runtime, model: nn.Module, spans: bool = False) -> nn.Module:
    """The model wrapped in our engine for ``rt.strategy`` ('single': the model itself)."""
    from .parallel import DataParallel, DistributedDataParallel

    if rt.strategy == "dp":
        return DataParallel(model, device_ids=list(rt.devices))
    if rt.strategy == "ddp":
        one_accelerator = rt.device.type != "cpu" and not spans
        return DistributedDataParallel(model, device_ids=[rt.device] if one_accelerator else None)
    return model


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """``optimizer`` must update ``model``'s parameters: others would not stay in sync."""
    mine = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    if foreign:
        shapes = [tuple(p.shape) for p in foreign[:3]]
        raise ConfigError(
            f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(shapes {shapes}{' ...' if len(foreign) > 3 else ''}); they would not be kept in "
            "sync across replicas",
            fix="build the optimizer from the model you pass: "
            "torch.optim.SGD(model.parameters(), ...).",
        )


def move_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Put optimizer state (e.g. loaded on the CPU) on its parameters' devices."""
    misplaced = any(
        isinstance(v, torch.Tensor) and k != "step" and v.device != p.device
        for p, state in optimizer.state.items()
        for k, v in state.items()
    )
    if misplaced:
        # torch's own loading policy puts each state tensor on its parameter's device (and
        # keeps Adam's `step` counters where torch wants them).
        optimizer.load_state_dict(optimizer.state_dict())


# -- the loader --------------------------------------------------------------------------------


def _shuffle_of(dl: DataLoader) -> bool:
    """shuffle=True/False from torch's default samplers; anything else is refused."""
    sampler = dl.sampler
    if dl.batch_size is None:
        what = "batch_sampler=" if dl.batch_sampler is not None else "batch_size=None"
        raise ConfigError(
            f"rt.prepare() cannot re-create a DataLoader built with {what}: the batches are "
            "not described by a batch size it could split over the replicas",
            fix="build the loader yourself with rw.loader(dataset, batch_size=..., sampler=...) "
            "and pass it to rt.prepare (an rw.loader is kept as it is).",
        )
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return True
    name = type(sampler).__name__
    if "DistributedSampler" in name:
        fix = (
            "rt.prepare builds the distributed sampler itself: pass DataLoader(dataset, "
            "batch_size=B, shuffle=True) without sampler=."
        )
    else:
        fix = (
            "build the loader yourself: rw.loader(dataset, batch_size=B, sampler=...) with a "
            "sampler that splits the data over the ranks, and pass that to rt.prepare."
        )
    raise ConfigError(
        f"rt.prepare() cannot re-create DataLoader(sampler={name}(...)): only shuffle=True "
        "or shuffle=False (RandomSampler / SequentialSampler) can be split over the ranks "
        "without changing what the sampler means",
        fix=fix,
    )


def _dataloader_kwargs(dl: DataLoader) -> dict[str, Any]:
    """Everything of ``dl`` except what the sampler and the batch contract decide."""
    keys = (
        "num_workers",
        "collate_fn",
        "pin_memory",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    )
    return {k: getattr(dl, k) for k in keys if hasattr(dl, k)}


def _rebuild(
    rt: Runtime, dl: DataLoader, global_batch_size: int | None, evaluation: bool
) -> Loader:
    shuffle = _shuffle_of(dl)
    in_process = len(rt.devices) if rt.strategy == "dp" else 1
    batch_size = dl.batch_size if global_batch_size is None else None
    if batch_size is not None and rt.strategy == "dp":
        # torch's DataParallel meaning: the loader's batch is the global batch, split.
        if dl.batch_size % in_process:
            below = dl.batch_size // in_process * in_process
            raise ConfigError(
                f"DataLoader(batch_size={dl.batch_size}) is the global batch under "
                f"strategy='dp' and does not split evenly over {in_process} devices",
                fix=f"use batch_size={below or in_process} or {below + in_process}, or "
                "rt.prepare(..., global_batch_size=...).",
            )
        batch_size = dl.batch_size // in_process
    return make_loader(
        dl.dataset,
        batch_size=batch_size,
        global_batch_size=global_batch_size,
        shuffle=shuffle,
        drop_last=dl.drop_last,
        evaluation=evaluation,
        replicas_in_process=in_process,
        **_dataloader_kwargs(dl),
    )


def describe_batch(strategy: str, loader: Loader, source: str) -> str:
    """The log line that says what the batch size means (``source``: how it was given)."""
    g, b, per = loader.global_batch_size, loader.batch_size, loader.per_device_batch_size
    if strategy == "ddp":
        split = f"global batch {g} = {b} per process x {loader.num_replicas} processes"
    elif strategy == "dp":
        split = f"global batch {g} = {per} per device x {loader.replicas_in_process} devices"
    else:
        split = f"global batch {g}"
    return f"rankwise prepare [{strategy}]: {source}: {split}"


def _source(rt: Runtime, given: Any, global_batch_size: int | None) -> str:
    if isinstance(given, Loader):
        return "rw.loader kept as built"
    if global_batch_size is not None:
        unused = given.batch_size != global_batch_size
        return f"global_batch_size={global_batch_size}" + (
            f" (the DataLoader's batch_size={given.batch_size} is not used)" * unused
        )
    b = given.batch_size
    return {
        "single": f"batch_size={b} is the batch per step",
        "ddp": f"batch_size={b} is per process (torch DDP's meaning)",
        "dp": f"batch_size={b} is the global batch, split over the devices "
        "(torch DataParallel's meaning)",
    }[rt.strategy]


def _check_kept(rt: Runtime, kept: Loader, global_batch_size: int | None) -> None:
    in_process = len(rt.devices) if rt.strategy == "dp" else 1
    if kept.replicas_in_process != in_process:
        raise ConfigError(
            f"the rw.loader was built with replicas_in_process={kept.replicas_in_process}, but "
            f"strategy={rt.strategy!r} splits each batch over {in_process} device(s)",
            fix=f"build it with replicas_in_process={in_process}, or pass a plain DataLoader "
            "and let rt.prepare build the loader.",
        )
    if global_batch_size is not None and global_batch_size != kept.global_batch_size:
        raise ConfigError(
            f"global_batch_size={global_batch_size} was given, but the rw.loader passed has "
            f"global batch {kept.global_batch_size}",
            fix="build the loader with rw.loader(..., global_batch_size=...) or drop the argument.",
        )


def prepare_loader(
    rt: Runtime,
    loader: DataLoader | Loader,
    *,
    global_batch_size: int | None = None,
    evaluation: bool = False,
) -> DeviceLoader:
    """``loader`` split over the replicas with our sampler; batches arrive on ``rt.device``.

    A plain ``DataLoader``'s ``batch_size`` keeps torch's meaning for the strategy ('single':
    per step; 'ddp': per process; 'dp': the global batch, split over the devices) unless
    ``global_batch_size`` is given. The meaning is logged once, on rank 0. ``evaluation=True``
    visits each sample exactly once (for ``rw.gather_for_metrics``). An ``rw.loader`` is kept.
    No sync point.
    """
    from .log import get_logger

    if isinstance(loader, DeviceLoader):
        loader = loader.loader
    if isinstance(loader, Loader):
        _check_kept(rt, loader, global_batch_size)
        built = loader
    elif isinstance(loader, DataLoader):
        built = _rebuild(rt, loader, global_batch_size, evaluation)
    else:
        raise ConfigError(
            f"loader={type(loader).__name__} is not a torch DataLoader nor an rw.loader",
            fix="pass DataLoader(dataset, batch_size=B, shuffle=...) or rw.loader(dataset, ...).",
        )
    line = describe_batch(rt.strategy, built, _source(rt, loader, global_batch_size))
    get_logger("rankwise.session").info(line + (" (evaluation: each sample once)" * evaluation))
    return DeviceLoader(built, rt.device)


class DeviceLoader:
    """An ``rw.Loader`` whose batches are moved to ``device`` (DataParallel: its output device).

    Keeps the loader's ``len``, ``set_epoch``, ``state_dict``/``load_state_dict`` (so
    checkpoints and exact resume work) and its batch attributes (``batch_size``,
    ``global_batch_size``, ``sampler``, ...). No sync point.
    """

    def __init__(self, loader: Loader, device: torch.device) -> None:
        self.loader = loader
        self.device = device
        # Copies from pinned host memory can overlap compute; from pageable memory they are
        # synchronous anyway, so non_blocking is only asked for where it helps.
        self._non_blocking = device.type != "cpu" and bool(loader.dataloader.pin_memory)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield _to(batch, self.device, self._non_blocking)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def _to(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    """``obj`` with every tensor in tuples, namedtuples, lists and dicts on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, tuple):
        moved = [_to(o, device, non_blocking) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else tuple(moved)
    if isinstance(obj, list):
        return [_to(o, device, non_blocking) for o in obj]
    if isinstance(obj, dict):
        return type(obj)((k, _to(v, device, non_blocking)) for k, v in obj.items())
    return obj


# -- all at once -------------------------------------------------------------------------------


def prepare(
    rt: Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    loader: DataLoader | Loader | None = None,
    *,
    global_batch_size: int | None = None,
) -> Any:
    """Model (moved, then wrapped), optimizer (state moved), loader (split, batches moved).

    Returns the model alone when only a model is given, ``(model, optimizer)`` without a
    loader, else ``(model, optimizer, loader)``.

    Sync point: all ranks under 'ddp' (the model's parameters are broadcast from rank 0).
    """
    if loader is None and global_batch_size is not None:
        raise ConfigError(
            f"global_batch_size={global_batch_size} was given without a loader",
            fix="pass the loader too: rt.prepare(model, optimizer, loader, global_batch_size=...).",
        )
    _refuse_wrapped(rt, model)
    if optimizer is not None:
        check_optimizer(optimizer, model)
    wrapped = prepare_model(rt, model)
    if optimizer is not None:
        move_optimizer_state(optimizer)  # the model has moved: its state follows
    if loader is None:
        return wrapped if optimizer is None else (wrapped, optimizer)
    return wrapped, optimizer, prepare_loader(rt, loader, global_batch_size=global_batch_size)
