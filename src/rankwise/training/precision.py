"""Mixed precision as a policy the session applies: autocast, fp32 master weights, a loss scaler.

``rw.init(precision="bf16-mixed")`` makes ``rt.prepare`` run the prepared model's forward under
``torch.autocast`` on its device type (parameters stay fp32: the "master weights"), and return
its outputs as fp32 so the loss is computed in full precision. ``"fp16-mixed"`` also needs a
loss scaler: fp16 gradients underflow without one. Engines (DP, DDP, pipelines) know nothing of
any of this; DataParallel's worker threads re-enter the caller's autocast state themselves.

The scaler is torch's ``GradScaler`` with one change: its found-inf decision is agreed across
ranks. Averaged gradients usually make it identical already (an inf on one rank becomes an inf
in the average), but gradients that were never averaged (a pipeline stage holds its own
parameters) or that overflow after the average would let one replica skip a step that another
takes, and the replicas would drift apart. So the flags are max-reduced before ``step`` uses them.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch import nn

from ..comm import collectives as comm
from ..errors import ConfigError
from ..job.plan import PRECISIONS, Precision, parse

__all__ = ["PRECISIONS", "Precision", "parse"]  # the policy is settled by rw.init (plan.py)


def model_device_type(model: nn.Module, default: torch.device) -> str:
    for p in model.parameters():
        return p.device.type
    return default.type


class _AutocastHooks:
    """Forward pre/post hooks that put one module's forward under autocast (fp32 outputs).

    Hooks rather than a wrapper module or a replaced ``forward``: ``state_dict`` keys, the
    model's type and ``deepcopy``/pickling stay as they were. ``always_call`` exits the
    autocast region even when the forward raises; the stack is per thread because autocast
    state is thread-local.
    """

    def __init__(self, policy: Precision, device_type: str) -> None:
        self.policy, self.device_type = policy, device_type
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"policy": self.policy, "device_type": self.device_type}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["policy"], state["device_type"])

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def enter(self, module: nn.Module, args: tuple) -> None:
        ctx = self.policy.autocast(self.device_type)
        ctx.__enter__()
        self._stack().append(ctx)

    def exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        self._stack().pop().__exit__(None, None, None)
        return None if output is None else _cast_floats(output, torch.float32)


class _InputCaster:
    """Forward pre-hook of 'bf16-true': floating inputs in the parameters' dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast_floats(args, self.dtype), _cast_floats(kwargs, self.dtype)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_cast_floats(o, dtype) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _cast_floats(v, dtype)) for k, v in obj.items())
    return obj


def convert_module(policy: Precision, model: nn.Module) -> nn.Module:
    """Before wrapping: 'bf16-true' stores the parameters in bf16; other policies change nothing."""
    if policy.name == "bf16-true":
        model.to(torch.bfloat16)
        model.register_forward_pre_hook(_InputCaster(torch.bfloat16), with_kwargs=True)
    return model


def apply_autocast(policy: Precision, wrapped: nn.Module, device_type: str) -> nn.Module:
    """After wrapping: the wrapper's forward under autocast (mixed policies only)."""
    if policy.mixed:
        hooks = _AutocastHooks(policy, device_type)
        wrapped.register_forward_pre_hook(hooks.enter)
        wrapped.register_forward_hook(hooks.exit, always_call=True)
    return wrapped


class AgreedGradScaler(torch.amp.GradScaler):
    """torch's ``GradScaler`` whose found-inf flags are max-reduced over all ranks.

    Every rank then skips (or takes) the same steps and keeps the same scale. The reduction
    happens in ``unscale_`` (called by ``step`` or before clipping), like torch's own
    ``ShardedGradScaler``, which keeps its flags in the same per-optimizer state.
    Sync point: all ranks, in ``unscale_``/``step``.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if comm.world_size() == 1:
            return
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = sum((float(f.item()) for f in flags.values()), 0.0)
        agreed = comm.all_reduce(local, "max")  # every rank calls it, flags or none
        for flag in flags.values():
            flag.fill_(agreed)


class ScaledOptimizer(torch.optim.Optimizer):
    """The optimizer ``rt.prepare`` returns under 'fp16-mixed': ``step`` goes through the scaler.

    ``step()`` unscales the gradients, skips the update when any rank found an inf/NaN, and
    updates the scale. It refuses gradients that did not come from ``rt.backward(loss)``:
    a plain ``loss.backward()`` would leave them unscaled and the update ``scale`` times too
    small, silently. Everything else (``param_groups``, ``state``, ``state_dict``, ``zero_grad``)
    is the wrapped optimizer's; ``.optimizer`` is that optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: AgreedGradScaler) -> None:
        # Not Optimizer.__init__: the state and groups are the wrapped optimizer's own.
        self.optimizer = optimizer
        self.scaler = scaler
        self._probe: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scaled_backward = False
        self._unscaled = False
        self._warned_clip = False

    @property
    def scaled_backward(self) -> bool:
        """Set by ``rt.backward``: the gradients hold ``loss * scale``'s."""
        return self._scaled_backward

    @scaled_backward.setter
    def scaled_backward(self, value: bool) -> None:
        self._scaled_backward = value
        # A few elements of one gradient, as rt.backward left them: if they have changed by
        # step() while still scaled, something (torch's clip_grad_norm_) worked on scaled values.
        grads = (p.grad for g in self.param_groups for p in g["params"] if p.grad is not None)
        grad = next(grads, None) if value else None
        self._probe = None if grad is None else (grad, grad.detach().reshape(-1)[:8].clone())

    def _warn_if_changed_while_scaled(self) -> None:
        if self._probe is None or self._unscaled or self._warned_clip:
            return
        grad, seen = self._probe
        now = grad.detach().reshape(-1)[:8]
        changed = not torch.equal(now, seen)
        if not changed:
            return
        self._warned_clip = True
        warnings.warn(
            "under precision='fp16-mixed' the gradients changed between rt.backward(loss) and "
            f"optimizer.step() while they were still multiplied by the loss scale "
            f"({self.scaler.get_scale():g}): torch.nn.utils.clip_grad_norm_ (or any change made "
            "there) then works on scaled values, e.g. it clips a norm "
            f"{self.scaler.get_scale():g} times too large. Fix: rt.clip_grad_norm_(model, "
            "max_norm), which unscales first, or optimizer.unscale_() before torch's clip.",
            UserWarning,
            stacklevel=3,
        )

    def __getattr__(self, name: str) -> Any:
        # Only for what this class lacks (e.g. the hook registries Optimizer's methods use):
        # hooks registered here land on the wrapped optimizer, whose step the scaler calls.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def unscale_(self) -> None:
        """Divide the gradients by the scale now (before clipping); once per step."""
        if not self._unscaled:
            self._check_scaled()
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure: Any = None) -> Any:
        """Sync point: all ranks (the found-inf flags are agreed)."""
        if closure is not None:
            raise ConfigError(
                "optimizer.step(closure) is not supported under precision='fp16-mixed'",
                fix="call rt.backward(loss) then optimizer.step() without a closure "
                "(torch's GradScaler has the same limit).",
            )
        self._check_scaled()
        self._warn_if_changed_while_scaled()
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scaled_backward = self._unscaled = False
        return result

    def _check_scaled(self) -> None:
        has_grads = any(p.grad is not None for g in self.param_groups for p in g["params"])
        if has_grads and not self.scaled_backward:
            raise ConfigError(
                "gradients were computed without the loss scaler under precision='fp16-mixed' "
                "(a plain loss.backward()?): the update would silently use unscaled fp16 "
                "gradients",
                fix="call rt.backward(loss) instead of loss.backward().",
            )

    def __repr__(self) -> str:
        return f"ScaledOptimizer({self.optimizer!r}, scale={self.scaler.get_scale()})"


def make_scaler(device_type: str) -> AgreedGradScaler:
    return AgreedGradScaler(device_type)
