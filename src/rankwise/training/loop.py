"""The training-loop verbs of the one-call API: backward, clipping, accumulation, ordering.

``rankwise.session.Session`` (what ``rw.init()`` returns) inherits these methods
(``rt.backward(loss)``, ``rt.clip_grad_norm_(model, 1.0)``, ``with rt.accumulate(model, steps=4):``,
``with rt.rank_zero_first():``); their state (the loss scaler, the prepared optimizers and
schedulers, the accumulation counters) lives in one ``LoopState`` per session. This module sits
in the session layer: it uses ``comm``, the engines and ``precision`` from below.

    rt = rw.init(precision="bf16-mixed")
    model, opt, loader = rt.prepare(model, opt, loader)
    for x, y in loader:
        with rt.accumulate(model, steps=4) as acc:
            rt.backward(F.cross_entropy(model(x), y))
            if acc.sync:
                rt.clip_grad_norm_(model, 1.0)
                opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import validate
from ..comm import collectives as comm
from ..errors import ConfigError
from ..output.metrics import MetricsLogger
from ..parallel.tensor.grad_norm import NormParts
from ..parallel.tensor.state import FullOptimState, FullState, has_split_layers
from ..pipeline import norm as pipeline_norm
from ..pipeline.state import pipeline_checkpoint_states, pipeline_in
from .precision import AgreedGradScaler, Precision, ScaledOptimizer, make_scaler

if TYPE_CHECKING:
    from ..runtime import Runtime


@dataclass
class LoopState:
    """What the loop verbs remember between calls (one per runtime, never shared)."""

    scaler: AgreedGradScaler | None = None
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)
    micro_batches: dict[int, int] = field(default_factory=dict)
    """id(model) -> micro-batches accumulated since the last synchronised one."""
    loss_divisor: int = 1
    """Set inside ``accumulate(..., reduction="mean")`` (the default): ``rt.backward`` divides
    by it."""
    accumulation_told: set[int] = field(default_factory=set)
    """The ``steps`` values whose global batch per optimizer step has been logged."""
    metrics: MetricsLogger | None = None
    timing: Any = None
    """The step anatomy's ``rankwise.timing.recorder.Recorder`` (session/anatomy.py), or None."""


@dataclass(frozen=True)
class Accumulation:
    """What ``rt.accumulate`` yields: whether this micro-batch synchronises (and steps)."""

    sync: bool
    """True on the last micro-batch of ``steps`` (or of the epoch): step the optimizer then."""
    index: int
    """This micro-batch's position in its group, from 0."""


def _tell_accumulation(loop: LoopState, steps: int) -> None:
    """Once per ``steps``: the prepare line's global batch is per micro-batch; say what an
    optimizer step sees with accumulation (``rt.accumulate(steps=4)`` on a global batch of
    32 steps the optimizer every 128 samples)."""
    if steps < 2 or steps in loop.accumulation_told or not loop.loaders:
        return
    loop.accumulation_told.add(steps)
    from ..output.log import get_logger

    g = loop.loaders[-1].global_batch_size
    get_logger("rankwise.session").info(
        f"rankwise accumulate: steps={steps}: global batch per optimizer step {g * steps} = "
        f"{g} per micro-batch (the prepare line's global batch) x {steps} micro-batches"
    )


class TrainingLoop:
    """Mixin of ``Runtime``: the loop verbs. Expects ``self.loop``, ``self.precision_policy``."""

    loop: LoopState
    precision_policy: Precision

    # -- mixed precision -------------------------------------------------------------------

    def autocast(self: Runtime) -> contextlib.AbstractContextManager:
        """The precision policy's autocast on this device (for code outside the prepared
        model's forward, e.g. ``DistributedPipeline.train_step``); a no-op at '32'."""
        return self.precision_policy.autocast(self.device.type)

    def backward(self: Runtime, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled under 'fp16-mixed' and divided by ``steps`` inside
        ``accumulate(model, steps)`` (its default ``reduction="mean"``), so a group's gradient
        is the mean over its micro-batches. Sync point: as the model's backward (DDP: all)."""
        validate.tensor("loss", loss, where="rt.backward()", fix="pass the loss tensor itself "
                        "(not loss.item()), e.g. rt.backward(F.cross_entropy(model(x), y)).")
        if self.loop.loss_divisor != 1:
            loss = loss / self.loop.loss_divisor
        if self.loop.scaler is None:
            loss.backward(**kwargs)
            return
        self.loop.scaler.scale(loss).backward(**kwargs)
        for opt in self.loop.optimizers:
            opt.scaled_backward = True

    # -- gradient clipping -----------------------------------------------------------------

    def clip_grad_norm_(
        self: Runtime, model: nn.Module, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients to a total norm of ``max_norm``; return the norm before clipping.

        The norm is that of the global gradient, the same on every rank: under DP/DDP the
        averaged gradients already are; a ``DistributedPipeline`` stage adds the other stages'
        parts; an engine that defines ``clip_grad_norm_`` (sharded) computes it itself.
        Unscales first under 'fp16-mixed'. Sync point: all ranks for a pipeline or an engine.
        """
        where = "rt.clip_grad_norm_()"  # numbers as torch's clip_grad_norm_ reads them (float())
        validate.module("model", model, where=where)
        validate.number("max_norm", max_norm, minimum=0, numeric_text=True, where=where)
        validate.number("norm_type", norm_type, numeric_text=True, where=where, example=2.0)
        self._unscale_for(model)
        if callable(getattr(model, "clip_grad_norm_", None)):
            pipeline_norm.refuse_sharded_pipeline(model)
            return model.clip_grad_norm_(max_norm, norm_type)
        params = [p for p in model.parameters() if p.grad is not None]
        parts = NormParts(model)
        if parts.groups or pipeline_norm.is_pipeline(model):
            counted = pipeline_norm.counted(model, params)  # a tied weight once
            total = _model_parallel_norm(model, counted, parts, float(norm_type))
        else:
            grads = [p.grad for p in params]
            total = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.tensor(0.0)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def clip_grad_value_(self: Runtime, model: nn.Module, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (unscaled first)."""
        validate.module("model", model, where="rt.clip_grad_value_()")
        validate.number("clip_value", clip_value, minimum=0, numeric_text=True,
                        where="rt.clip_grad_value_()")  # fmt: skip
        self._unscale_for(model)
        torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)

    def _unscale_for(self: Runtime, model: nn.Module) -> None:
        mine = {id(p) for p in model.parameters()}
        # A sharded engine's optimizer steps its flat shards, not the model's parameters.
        own = getattr(model, "optimizer", None)
        if isinstance(own, torch.optim.Optimizer):
            mine |= {id(p) for g in own.param_groups for p in g["params"]}
        for opt in self.loop.optimizers:
            if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
                opt.unscale_()

    # -- gradient accumulation -------------------------------------------------------------

    @contextlib.contextmanager
    def no_backward_sync(self: Runtime, model: nn.Module, enabled: bool = True) -> Iterator[None]:
        """The model's ``no_sync()`` when ``enabled`` (backward passes inside communicate
        nothing); a plain block for a model without one (one process: nothing to skip)."""
        validate.module("model", model, where="rt.no_backward_sync()")
        skip = enabled and callable(getattr(model, "no_sync", None))
        with model.no_sync() if skip else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def accumulate(
        self: Runtime,
        model: nn.Module,
        steps: int,
        *,
        reduction: str = "mean",
        scale_loss: bool | None = None,
    ) -> Iterator[Accumulation]:
        """One micro-batch of ``steps``: gradients are averaged across replicas only on the last.

        Yields an ``Accumulation``; step the optimizer when ``.sync`` is True. The last
        micro-batch of an epoch of a prepared loader synchronises even when the group is short.
        ``reduction="mean"`` (the default, as Accelerate and Fabric): ``rt.backward`` divides
        the loss by ``steps``, so a group of mean losses gives the gradient of the mean over the
        group (one big batch's; a short last group is divided by ``steps`` too).
        ``reduction="sum"``: the micro-batches' gradients add up, undivided. ``scale_loss=``
        is the older spelling (True: "mean", False: "sum"). A plain ``loss.backward()`` is never
        divided. Sync point: all ranks on ``.sync``.
        """
        validate.module("model", model, where="rt.accumulate()")
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                f"rt.accumulate(steps={steps!r}): steps must be a positive integer",
                fix="pass the number of micro-batches per optimizer step, e.g. steps=4.",
            )
        reduction = _reduction(reduction, scale_loss)
        _tell_accumulation(self.loop, steps)
        index = self.loop.micro_batches.get(id(model), 0)
        sync = index + 1 >= steps or any(
            getattr(dl, "at_last_batch", False) for dl in self.loop.loaders
        )
        self.loop.micro_batches[id(model)] = 0 if sync else index + 1
        previous = self.loop.loss_divisor
        self.loop.loss_divisor = steps if reduction == "mean" else 1
        try:
            with self.no_backward_sync(model, enabled=not sync):
                yield Accumulation(sync=sync, index=index)
        finally:
            self.loop.loss_divisor = previous

    # -- ordering --------------------------------------------------------------------------

    @contextlib.contextmanager
    def rank_zero_first(self: Runtime, *, local: bool = False) -> Iterator[None]:
        """Rank 0 runs the block first (a download, a cache); the others wait, then run it.

        Sync point: all ranks (one barrier each).
        """
        first = (self.local_rank if local else self.rank) == 0
        if not first:
            comm.barrier()
        yield
        if first:
            comm.barrier()

    def local_rank_zero_first(self: Runtime) -> contextlib.AbstractContextManager:
        """``rank_zero_first`` per machine: local rank 0 of each node first (node-local
        caches). Sync point: all ranks."""
        return self.rank_zero_first(local=True)

    # -- metrics ---------------------------------------------------------------------------

    def log(
        self: Runtime,
        metrics: dict[str, Any],
        step: int | None = None,
        *,
        reduce: str | None = None,
    ) -> None:
        """Write ``metrics`` (rank 0) to the run's CSV/JSONL files (and TensorBoard when
        installed), after reducing each value over the ranks with ``reduce`` ('mean', 'sum',
        'max', 'min') when given. Sync point: all ranks when ``reduce`` is given."""
        validate.mapping("metrics", metrics, "a dict of metric names to numbers", where="rt.log()",
                         example="{'loss': loss.item()}")  # fmt: skip
        validate.integer("step", step, optional=True, where="rt.log()")
        self.log_to().log(metrics, step=step, reduce=reduce)

    def log_to(
        self: Runtime,
        log_dir: str | Path | None = None,
        *,
        tensorboard: bool | None = None,
        log_with: str | Sequence[str] | None = None,
        project: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> MetricsLogger:
        """Where ``rt.log`` writes: ``log_dir`` (default ``rankwise_logs/``) and the trackers
        ``log_with`` names (``"csv"``, ``"jsonl"``, ``"tensorboard"``, ``"mlflow"``,
        ``"wandb"``; default CSV, JSONL and TensorBoard when installed), their run named
        ``project``/``run_name``, ``config`` logged once; ``init_kwargs`` per tracker. Returns
        the logger; called again with arguments, it finishes the previous one and opens anew.
        Rank 0 writes; every rank checks the arguments. No sync point."""
        _check_log_to(log_dir, project, run_name, config, init_kwargs)
        given = (log_dir, tensorboard, log_with, project, run_name, config, init_kwargs)
        if self.loop.metrics is None or any(a is not None for a in given):
            if self.loop.metrics is not None:
                self.loop.metrics.close()
            self.loop.metrics = MetricsLogger(
                log_dir or "rankwise_logs",
                tensorboard=tensorboard,
                log_with=log_with,
                project=project,
                run_name=run_name,
                config=config,
                init_kwargs=init_kwargs,
            )
        return self.loop.metrics

    # -- what rt.prepare and rt.save/load call ---------------------------------------------

    def _prepare_optimizer(self: Runtime, optimizer: Any, device_type: str) -> Any:
        if not self.precision_policy.scales_loss:
            return optimizer
        if self.loop.optimizers:
            raise ConfigError(
                "precision='fp16-mixed' supports one optimizer per run (one loss scale); "
                "rt.prepare was given a second one",
                fix="use one optimizer with several param_groups, or precision='bf16-mixed' "
                "(no loss scaler).",
            )
        self.loop.scaler = make_scaler(device_type)
        wrapped: ScaledOptimizer = ScaledOptimizer(optimizer, self.loop.scaler)
        self.loop.optimizers.append(wrapped)
        return wrapped

    def _checkpoint_kwargs(self: Runtime, kwargs: dict[str, Any], saving: bool) -> dict[str, Any]:
        """``rt.save``/``rt.load``: the prepared scheduler and the loss scale come along."""
        if len(self.loop.schedulers) == 1:
            kwargs.setdefault("scheduler", self.loop.schedulers[0])
        if saving and self.loop.scaler is not None:
            kwargs.setdefault("grad_scaler", self.loop.scaler.state_dict())
        return kwargs

    def _restore_scaler(self: Runtime, result: dict[str, Any]) -> None:
        state = result.get("extra", {}).get("grad_scaler")
        if state is not None and self.loop.scaler is not None:
            self.loop.scaler.load_state_dict(state)


def _reduction(reduction: str, scale_loss: bool | None) -> str:
    """``accumulate``'s reduction from ``reduction=`` and the older ``scale_loss=``."""
    if reduction not in ("mean", "sum"):
        raise ConfigError(
            f"rt.accumulate(reduction={reduction!r}) is not 'mean' nor 'sum'",
            fix="pass reduction='mean' (the gradient of the mean over the group, the default) "
            "or reduction='sum' (the micro-batches' gradients added up).",
        )
    if scale_loss is None:
        return reduction
    older = "mean" if scale_loss else "sum"
    if reduction != "mean" and older != reduction:
        raise ConfigError(
            f"rt.accumulate(reduction={reduction!r}, scale_loss={scale_loss!r}) disagree",
            fix="pass reduction= alone ('mean' or 'sum').",
        )
    return older


def _model_parallel_norm(
    model: nn.Module, params: list[nn.Parameter], parts: NormParts, norm_type: float
) -> torch.Tensor:
    """The whole model's gradient norm when its parameters are split over ranks.

    Tensor-parallel slices are summed over their tensor group and the parameters held whole
    counted once (``NormParts``); a ``DistributedPipeline`` then sums that over every rank and
    divides by the number of copies of each stage (its data-parallel replicas hold the same
    averaged gradients, its tensor peers the same stage total). Sync point: the tensor group;
    all ranks for a pipeline.
    """
    device = params[0].grad.device if params else torch.device("cpu")
    dtype = params[0].grad.dtype if params else torch.float32
    local = parts.local(((parts.part_of(p), p.grad) for p in params), norm_type, device)
    powered = parts.total(local, norm_type)
    inf = math.isinf(norm_type)
    if pipeline_norm.is_pipeline(model):
        copies = comm.world_size() // pipeline_norm.pipeline_size(model)
        powered = comm.all_reduce(powered, "max") if inf else comm.all_reduce(powered, "sum") / copies
    return (powered if inf else powered ** (1.0 / norm_type)).to(dtype)


def full_states(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``rt.save``/``rt.load``'s model and optimizer, seen whole when the model is split by
    tensor parallelism (``FullState``, ``FullOptimState``): the file holds the unsplit model's
    parameters and optimizer state, so it resumes at any mesh, or in a plain process."""
    model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
    if not isinstance(model, nn.Module) or isinstance(model, FullState):
        return kwargs  # nothing split (a wrong type is named by save/load_checkpoint)
    if pipeline_in(model) is not None:
        return pipeline_checkpoint_states(kwargs, model, optimizer, has_split_layers(model))
    if not has_split_layers(model):
        return kwargs
    out = dict(kwargs, model=FullState(model))
    if optimizer is not None and not isinstance(optimizer, FullOptimState):
        out["optimizer"] = FullOptimState(optimizer, model)
    return out


def _check_log_to(log_dir: Any, project: Any, run_name: Any, config: Any, kwargs: Any) -> None:
    """``rt.log_to``'s arguments by type (``rankwise.validate``), before a tracker opens."""
    where = "rt.log_to()"
    validate.path("log_dir", log_dir, optional=True, where=where)
    validate.text("project", project, optional=True, where=where)
    validate.text("run_name", run_name, optional=True, where=where)
    if config is not None:
        validate.mapping("config", config, "a dict of settings", where=where, example="{'lr': 3e-4}")
    if kwargs is not None:
        validate.mapping("init_kwargs", kwargs, "a dict per tracker name", where=where,
                         example="{'wandb': {'entity': 'me'}}")  # fmt: skip
