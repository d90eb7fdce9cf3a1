"""Communication hooks with torch's signature: ``hook(state, bucket) -> Future[Tensor]``.

``DistributedDataParallel.register_comm_hook(state, hook)`` hands each gradient bucket to
``hook`` instead of all-reducing it, so torch's own hooks run unchanged:
``torch.distributed.algorithms.ddp_comm_hooks`` (``default_hooks.allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``, ...).

:class:`GradBucket` offers the methods of torch's ``dist.GradBucket`` that hooks call. As in
torch, the bucket holds the *sum* of this rank's gradients (not divided by the world size):
the hook divides, and the value of the future it returns becomes the bucket's gradients.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError, HookError, ModelError


class GradBucket:
    """One bucket as a communication hook sees it (torch's ``dist.GradBucket`` methods).

    Built by the reducer from what it holds for bucket ``index``: its flat ``buffer``, each
    parameter's gradient view into it, the parameters, and whether it is the last bucket.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        parameters: list[torch.Tensor],
        last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients, self._parameters, self._last = gradients, parameters, last

    def index(self) -> int:
        """Position of the bucket; 0 is the first to be ready (the last layers)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D tensor of the bucket's gradients (this rank's, summed, not averaged)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the tensor ``buffer()`` returns (torch hooks use it to stage a result)."""
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, as a view into ``buffer()``."""
        return list(self._gradients)

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the same order as ``gradients()``."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """True for the last bucket reduced in a backward pass."""
        return self._last

    def is_the_last_bucket_to_allreduce(self) -> bool:
        """Old spelling of :meth:`is_last`, kept by torch."""
        return self.is_last()


# torch's DistributedDataParallel wording for each refusal, kept verbatim before our own text
# (code and torch's tests match it).
NOT_CALLABLE = "Communication hook must be callable."
BUCKET_ANNOTATION = "Communication hook: bucket annotation should be dist.GradBucket."
RETURN_ANNOTATION = (
    "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
)
ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once."
NOT_A_FUTURE = "DDP communication hook's callback must return a torch.futures.Future object, but got"


def check_hook(hook: Any, already: bool, compression: object) -> None:
    """Refuse what torch refuses (not callable, a second hook, wrong annotations) with torch's
    reason first, and our compression with a hook."""
    if not callable(hook):
        raise HookError(
            f"{NOT_CALLABLE} Got {hook!r}",
            fix="pass a function hook(state, bucket) -> torch.futures.Future[torch.Tensor], "
            "e.g. torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook.",
        )
    if already:
        raise ModelError(
            ONCE,
            fix="register one hook; to combine behaviours, write one hook that does both.",
        )
    if compression is not None:
        raise ConfigError(
            f"compression={compression!r} and a communication hook both decide what travels",
            fix="use one: compression='bf16'/'fp16', or a hook such as fp16_compress_hook.",
        )
    sig = inspect.signature(hook)
    params = list(sig.parameters.values())
    bucket_ann = params[1].annotation if len(params) > 1 else inspect.Parameter.empty
    if not _names(bucket_ann, (dist.GradBucket, GradBucket), "GradBucket"):
        raise ConfigError(
            f"{BUCKET_ANNOTATION} The bucket argument is annotated {bucket_ann!r}",
            fix="annotate it dist.GradBucket (or not at all).",
        )
    returns = sig.return_annotation
    if not _names(returns, (torch.futures.Future[torch.Tensor], torch.futures.Future), "Future"):
        raise ConfigError(
            f"{RETURN_ANNOTATION} The hook is annotated -> {returns!r}",
            fix="return a torch.futures.Future whose value is the reduced bucket.buffer(), "
            "annotated -> torch.futures.Future[torch.Tensor] (or not annotated).",
        )


def _names(annotation: Any, accepted: tuple, word: str) -> bool:
    """Unannotated, one of ``accepted``, or (``from __future__ import annotations``) a string
    naming it."""
    if annotation is inspect.Parameter.empty or annotation in accepted:
        return True
    return isinstance(annotation, str) and word in annotation


def check_future(result: Any) -> Any:
    """What a hook returned, if it is a future (torch's RuntimeError otherwise, at backward)."""
    if not isinstance(result, torch._C.Future):
        raise ModelError(
            f"{NOT_A_FUTURE} {type(result).__module__}.{type(result).__qualname__}",
            fix="return a torch.futures.Future from the hook, e.g. "
            "dist.all_reduce(bucket.buffer(), async_op=True).get_future().",
        )
    return result


HookFn = Callable[[Any, GradBucket], torch.futures.Future]


def take_result(result: Any, flat: torch.Tensor, b: int) -> None:
    """Copy what a communication hook's future returned into bucket ``b``'s flat buffer."""
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    if not isinstance(result, torch.Tensor) or result.numel() != flat.numel():
        got = type(result).__name__ if not isinstance(result, torch.Tensor) else result.shape
        raise ConfigError(
            f"the communication hook's future for bucket {b} returned {got}, expected a tensor "
            f"of {flat.numel()} elements (the bucket's buffer)",
            fix="return a torch.futures.Future whose value is the reduced bucket.buffer().",
        )
    if result.data_ptr() != flat.data_ptr():
        with torch.no_grad():
            flat.copy_(result.view(-1))
