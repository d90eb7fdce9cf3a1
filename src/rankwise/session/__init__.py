"""The one-call API: ``rt = rw.init(strategy=...)``, then ``rt.prepare(model, optimizer, loader)``.

The same training loop runs on one device, with DataParallel or with DDP by changing one word:

    rt = rw.init(strategy="auto")          # or any name of rankwise.strategies.STRATEGIES
    model, opt, loader = rt.prepare(model, opt, loader)
    for x, y in loader:                    # batches arrive on the right device
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()

``prepare`` does, in the order the pitfalls require (docs/pitfalls.md): refuse a model that is already
wrapped; move the model to its device, then wrap it (pitfall 1); move optimizer state that was
created elsewhere; rebuild a plain ``DataLoader`` as ``rw.loader`` with our distributed sampler
(pitfall 3), keeping its batch size with the meaning torch gives it under that strategy, said
once in the log (pitfall 4). Printing and saving go through ``rt.print``/``rt.save``, which are
rank-aware (pitfalls 5 and 6).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import runtime, validate
from ..checkpoint.pretrained import load_pretrained, save_pretrained
from ..checkpoint.state_dict import unwrap_model
from ..data import Loader
from ..diagnose import fingerprints
from ..errors import ConfigError
from ..job.env import DistEnv
from ..job.plan import check_init_arguments
from ..output.log import print0
from ..parallel import deferred
from ..timing import clock
from ..training import anatomy, precision
from ..training.loop import LoopState, TrainingLoop
from . import first_batch, formats, guards, saving
from .auto import settle as settle_auto
from .evaluation import evaluation_reason, padding_warning
from .loader import DeviceLoader, describe_batch, prepare_loader
from .model import (
    agreed_for,
    check_optimizer,
    move_optimizer_state,
    prepare_model,
    refuse_exact_in_bf16,
    refuse_wrapped,
    wrapper,
)
from .pipeline import PipelineOptions, pipeline_stages
from .saving import SaveRecord
from .sharded import warn_if_too_big

__all__ = [
    "DeviceLoader",
    "Session",
    "check_optimizer",
    "describe_batch",
    "init",
    "move_optimizer_state",
    "prepare",
    "prepare_loader",
    "prepare_model",
    "refuse_wrapped",
]


@dataclass(frozen=True, kw_only=True)
class Session(runtime.Runtime, TrainingLoop):
    """What ``rw.init()`` returns: the ``Runtime`` (data: env, device, backend, strategy,
    precision) plus the one-call API: ``prepare``/``prepare_loader`` (this package's functions
    with the runtime filled in), the loop verbs of ``rankwise.training.loop`` (``backward``,
    ``clip_grad_norm_``, ``accumulate``, ``log``, ...), ``print`` (an alias of ``rw.print0``)
    and ``save``/``load`` (``rw.save_checkpoint``/``rw.load_checkpoint`` plus what ``prepare``
    set up: the scheduler and the loss scale).
    """

    loop: LoopState = field(default_factory=LoopState, repr=False, compare=False)
    """The training-loop verbs' state: scaler, prepared optimizers, schedulers, loaders."""

    prepared: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False, compare=False)
    """What ``prepare`` was given and returned: given again, it is refused (session/guards.py)."""

    saves: SaveRecord = field(default_factory=SaveRecord, repr=False, compare=False)
    """The checkpoint folders this run loaded or saved (session/saving.py)."""

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loader: Any = None,
        *,
        global_batch_size: int | None = None,
        scheduler: Any = None,
        wrap: Any = None,
        pipeline_schedule: str | None = None,
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        loss_fn: Any = None,
        init: Callable[[nn.Module], Any] | None = None,
        exact_init: bool = False,
    ) -> Any:
        """``prepare(rt, ...)``: move (or, built on the meta device, initialise), then wrap
        the model; split the loader. ``init``: ``init(module)`` as ``model.apply(init)`` calls
        it (children first), instead of each module's ``reset_parameters()``; ``exact_init``:
        equal to an eager CPU build at the same seed, bit for bit.

        Sync point: all ranks under a multi-process strategy (ddp, zero1/2/3, auto).
        """
        pipeline = PipelineOptions(schedule=pipeline_schedule, microbatches=microbatches,
                                   stages_per_rank=stages_per_rank, loss_fn=loss_fn)  # fmt: skip
        return prepare(
            self,
            model,
            optimizer,
            loader,
            global_batch_size=global_batch_size,
            scheduler=scheduler,
            wrap=wrap,
            pipeline=pipeline,
            init=init,
            exact_init=exact_init,
        )

    def full_parameters(
        self, model: nn.Module, *, writeback: bool = True
    ) -> contextlib.AbstractContextManager[nn.Module]:
        """``with rt.full_parameters(model) as bare:`` the bare model with every parameter
        present, e.g. for ``bare.generate(...)`` or evaluation. Under 'zero3' the shards are
        gathered for the block (FSDP's ``summon_full_params``; ``model.module`` works inside);
        with ``writeback`` changes made inside are kept. Other strategies hold full
        parameters already: the block just gets the bare model. Not for training steps.

        Sync point: all ranks under 'zero3'.
        """
        validate.module("model", model, where="rt.full_parameters()")
        summon = getattr(model, "full_parameters", None)
        if callable(summon):
            return summon(writeback=writeback)
        return contextlib.nullcontext(unwrap_model(model))

    def prepare_loader(
        self, loader: Any, *, global_batch_size: int | None = None, evaluation: bool | None = None
    ) -> Any:
        """``prepare_loader(rt, ...)``: a loader split over the replicas, batches on the
        device; ``evaluation=True``: each sample once. Left out (None), an unshuffled loader
        named as evaluation data (``test``/``val``/``eval`` on the calling line, a data set
        with ``train=False``) is exact, and another unshuffled one that pads says so
        (``evaluation.py``; docs/data.md). No sync point."""
        if evaluation not in (None, True, False):
            validate.fail("evaluation", evaluation, "True, False or None", where=
                          "rt.prepare_loader()", fix="pass evaluation=True for each sample once.")
        reason = evaluation_reason(loader) if evaluation is None else None
        if evaluation or reason is not None:
            return prepare_loader(self, loader, global_batch_size=global_batch_size,
                                  evaluation=True, recognised=reason)  # fmt: skip
        guards.refuse_prepared_twice(self.prepared, "rt.prepare_loader", loader=loader)
        prepared = _training_loader(self, loader, global_batch_size, agree=False)
        said = padding_warning(loader, prepared) if evaluation is None else None
        if said is not None and self.rank == 0:
            guards.warn_at_user(said)
        return prepared

    print = staticmethod(print0)
    """Alias of ``rw.print0``: ``print`` on rank 0 only."""

    def save(
        self, path: str | Path, *, sharded: bool | None = None, background: bool = False,
        **kwargs: Any,
    ) -> Any:
        """``rw.save_checkpoint`` with the prepared scheduler and loss scale, in the format the
        strategy registry gives (``sharded``: DCP's folder, every rank writing its shards; a
        mesh with tensor or pipeline ranks too; else one file: ``session/formats.py``).
        ``background=True`` returns a ``PendingSave`` once the state is in host memory and
        writes it in a thread (the next save waits for it). Refuses replicas that drifted
        apart, warns about a folder reused without ``rt.load`` (``saving.py``). Sync point:
        all ranks (call it on every rank)."""
        kwargs = self._checkpoint_kwargs(kwargs, saving=True)
        guards.warn_scheduler_not_saved(kwargs)
        saving.before_save(self, path, kwargs)  # drifted replicas refused, a reused folder said
        with clock.span("checkpoint"):
            return formats.save(self, path, sharded, background, kwargs)

    def load(self, path: str | Path, **kwargs: Any) -> dict[str, Any]:
        """``rw.load_checkpoint`` (either format: a sharded folder is read piece by piece into
        what each rank holds), mapped to this process's device; restores the loss scale. No
        sync point."""
        result = formats.load(path, self._checkpoint_kwargs(kwargs, saving=False))
        self._restore_scaler(result)
        saving.remember_loaded(self.saves, path)
        return result

    def replicas(self, model: nn.Module, optimizer: Any = None, loader: Any = None,
                 **kwargs: Any) -> Any:  # fmt: skip
        """In-memory replicas of the training state (``rankwise.replicas.Replicas``: ``every``,
        ``global_batch``, ``folder``), with the prepared scheduler and loss scale, resumed at
        any world by ``.restore()`` (docs/elastic.md). Sync point: all ranks."""
        from ..replicas import Replicas

        sizes = self.mesh.sizes if self.mesh is not None else {}
        if sizes.get("tensor", 1) > 1 or sizes.get("pipeline", 1) > 1:
            raise ConfigError(
                f"rt.replicas() under a mesh of {dict(sizes)}: in-memory replicas keep whole "
                "replicas of data-parallel state (ddp, zero1-3), not tensor or pipeline slices",
                fix="use disk checkpoints (rt.save) under tensor or pipeline parallelism.",
            )
        state = self._checkpoint_kwargs({}, saving=False)
        kwargs.setdefault("scheduler", state.get("scheduler"))
        kwargs.setdefault("local_world", self.env.local_world_size)
        scaler = self.loop.scaler
        extra = None if scaler is None else (lambda: {"grad_scaler": scaler.state_dict()})
        return Replicas(model=model, optimizer=optimizer, loader=loader, extra=extra,
                        after_restore=self._restore_scaler, **kwargs)  # fmt: skip

    def load_pretrained(self, model: nn.Module, path: str | Path, **kwargs: Any) -> Any:
        """``rw.load_pretrained``: a safetensors checkpoint (file, or a folder with its index)
        into the prepared ``model``, each rank reading only its part. Sync point: all ranks
        when the model is prepared for several processes."""
        return load_pretrained(model, path, **kwargs)

    def save_pretrained(self, model: nn.Module, directory: str | Path, **kwargs: Any) -> Path:
        """``rw.save_pretrained``: the whole model as safetensors (Hugging Face's layout),
        streamed one unit at a time, written by rank 0. Sync point: all ranks."""
        return save_pretrained(model, directory, **kwargs)


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
) -> Session:
    """``rw.init``: ``rankwise.runtime.init`` returning a ``Session`` (the one-call API).

    Sync point: all ranks (the rendezvous), when world size > 1.
    """
    check_init_arguments(backend, device, timeout, env)  # before anything is joined
    rt = runtime.init(
        backend,
        device=device,
        timeout=timeout,
        env=env,
        strategy=strategy,
        devices=devices,
        precision=precision,
        mesh=mesh,
        debug=debug,
        kind=Session,
    )
    fingerprints.watch_world()  # stalls in raw torch.distributed calls are reported too
    return rt


def prepare(
    rt: Session,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    loader: DataLoader | Loader | None = None,
    *,
    global_batch_size: int | None = None,
    scheduler: Any = None,
    wrap: Any = None,
    pipeline: PipelineOptions | None = None,
    init: Callable[[nn.Module], Any] | None = None,
    exact_init: bool = False,
) -> Any:
    """Model (moved, then wrapped), optimizer (state moved), loader (split, batches moved).

    Returns the model alone when only a model is given, ``(model, optimizer)`` without a
    loader, else ``(model, optimizer, loader)``; a ``scheduler`` is appended unchanged (and
    saved/restored by ``rt.save``/``rt.load``). ``rt.precision`` is applied here
    (``rankwise.training.precision``): autocast around the model's forward, a loss-scaling optimizer
    under 'fp16-mixed'. ``wrap``: which modules 'zero3' gathers as one unit (a module class,
    a set of classes or a function ``module -> bool``; default: each block of a ``ModuleList``
    of identical blocks, e.g. a transformer's layers; see docs/zero.md); other strategies do
    not use it. A model built on the meta device is initialised here (``init``, ``exact_init``:
    docs/zero.md, "Models larger than one process").

    Sync point: all ranks under a multi-process strategy (ddp, zero1/2/3, launched 'auto'):
    rank 0's parameters are broadcast, 'auto' agrees on the device capacity, and with a loader
    the ranks' batch sizes are gathered (``agree.py``). Once more, later: the prepared model's
    first training forward compares what the ranks read (``first_batch.py``).
    """
    _refuse_bad_arguments(rt, model, optimizer, loader, global_batch_size)
    given_optimizer = optimizer
    how = deferred.plan(model, init, exact_init)  # None: not built on the meta device
    wrapped, optimizer = _with_precision(rt, model, optimizer, wrap, how, pipeline)
    first_batch.watch(rt, wrapped)  # a loader that was not split: said at the first step
    if scheduler is not None:
        rt.loop.schedulers.append(scheduler)
    tail = () if scheduler is None else (scheduler,)
    prepared = None if loader is None else _training_loader(rt, loader, global_batch_size, agree=True)
    guards.warn_small_batchnorm(rt, model, wrapped, None if prepared is None else prepared.batch_size)
    guards.remember_prepared(rt.prepared, model, wrapped, given_optimizer, optimizer)
    anatomy.start(rt, wrapped, optimizer)  # step timing, on by default (rankwise.timing)
    if loader is None:
        return wrapped if optimizer is None and not tail else (wrapped, optimizer, *tail)
    return (wrapped, optimizer, prepared, *tail)


def _refuse_bad_arguments(
    rt: Session, model: Any, optimizer: Any, loader: Any, global_batch_size: int | None
) -> None:
    """``rt.prepare``'s checks, before anything moves: each names the argument and the fix."""
    guards.refuse_loader_as_model(rt.prepared, model)  # before the type check: says the call
    guards.check_arguments(model, optimizer, global_batch_size)
    guards.refuse_batch_size_without_loader(loader, global_batch_size)
    guards.refuse_prepared_twice(rt.prepared, model=model, optimizer=optimizer, loader=loader)
    refuse_wrapped(rt, model)
    if optimizer is not None:
        check_optimizer(optimizer, model)


def _training_loader(
    rt: Session, loader: Any, global_batch_size: int | None, *, agree: bool
) -> DeviceLoader:
    """A training loader, prepared and remembered: ``rt.accumulate`` syncs on its last batch,
    it cannot be prepared again, and iterating the original warns. ``agree``: compare the
    ranks' batch sizes (``rt.prepare``'s sync point; ``rt.prepare_loader`` has none)."""
    prepared = prepare_loader(rt, loader, global_batch_size=global_batch_size, agree=agree)
    rt.loop.loaders.append(prepared)
    guards.warn_when_original_iterated(loader, rt.strategy, rt.world_size)
    guards.remember_prepared(rt.prepared, loader, prepared)
    return prepared


def _with_precision(
    rt: Session,
    model: nn.Module,
    optimizer: Any,
    wrap: Any,
    how: deferred.DeferredInit | None,
    pipeline: PipelineOptions | None,
) -> tuple[nn.Module, Any]:
    policy = rt.precision_policy
    refuse_exact_in_bf16(how, policy.name)
    precision.convert_module(policy, model)  # 'bf16-true': bf16 parameters, before any copy
    if not settle_auto(rt, model, optimizer):  # 'auto' logs its own reason
        warn_if_too_big(rt, model, optimizer)
    pipeline = pipeline or PipelineOptions()
    model, optimizer = pipeline_stages(rt, model, optimizer, pipeline, how)  # this rank's stages
    with agreed_for(rt, how):  # a meta model: every rank draws from the same random state
        wrapped, optimizer = wrapper(rt.strategy_spec)(rt, model, optimizer, wrap, how)
    device_type = precision.model_device_type(model, rt.device)
    precision.apply_autocast(policy, wrapped, device_type)
    if optimizer is not None:
        move_optimizer_state(optimizer)  # the model has moved: its state follows
        optimizer = rt._prepare_optimizer(optimizer, device_type)
    return wrapped, optimizer
