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


def check_hook(hook: Any, already: bool, compression: object) -> None:
    """Refuse what torch refuses (a second hook, a non-callable) and our compression with it."""
    if not callable(hook):
        raise HookError(
            f"communication hook {hook!r} is not callable",
            fix="pass a function hook(state, bucket) -> torch.futures.Future[torch.Tensor], "
            "e.g. torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook.",
        )
    if already:
        raise ModelError(
            "register_comm_hook can only be called once",
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
    if bucket_ann not in (inspect.Parameter.empty, dist.GradBucket, "dist.GradBucket") and (
        bucket_ann is not GradBucket
    ):
        raise ConfigError(
            f"communication hook: the bucket argument is annotated {bucket_ann!r}",
            fix="annotate it dist.GradBucket (or not at all).",
        )


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
