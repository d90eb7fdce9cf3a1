"""The backward split in two for zero-bubble schedules: input gradients now, weights later.

A stage's backward does two jobs: the gradient of its input (the previous stage waits for it:
``I``) and the gradients of its weights (nobody waits: ``W``, run when the rank would idle).
Autograd computes both in one pass, so the split is made in the forward: each layer that owns
weights and maps one tensor to one tensor (``nn.Linear``, ``nn.Embedding``, the norms,
convolutions, our tensor-parallel layers) runs on a detached copy of its input, and a
``_Cut`` node joins its output back to the real input. In the ``I`` pass the ``_Cut`` computes
the layer's input gradient from its own small graph (``retain_graph``) and keeps the output
gradient; the ``W`` pass later computes the weights' gradients from that graph and that
output gradient. Each weight gradient is computed exactly once (nothing is recomputed: the
``I`` pass never asks a layer for its weights' gradients, the ``W`` pass never for inputs),
and a weight used by two layers gets both contributions.

Weights used outside such layers (a bare ``nn.Parameter`` in a custom forward) get their
gradient in the ``I`` pass, as in an unsplit backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

_CUTTABLE = (
    nn.Linear, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
    nn.Conv1d, nn.Conv2d, nn.Conv3d,
)  # fmt: skip
"""Layers that map one tensor to one tensor and do not save their output for backward."""

Key = tuple[int, int]
"""(stage, micro_batch)."""


def cuttable(module: nn.Module) -> bool:
    """True for a layer whose weights' gradients the ``W`` pass computes."""
    if not any(True for _ in module.parameters(recurse=False)):
        return False
    return isinstance(module, _CUTTABLE) or hasattr(module, "tp_splits")


class _Cut(torch.autograd.Function):
    """Identity from the layer's output value; its backward is the layer's input gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, x: torch.Tensor, record: list) -> torch.Tensor:
        ctx.record = record
        return record[1].detach()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        record = ctx.record
        module, y, x_cut, pending = record
        dx = None
        if x_cut.requires_grad:
            (dx,) = torch.autograd.grad(y, x_cut, grad_out, retain_graph=True)
        pending.append((module, y, grad_out))
        record.clear()  # the W pass holds what it needs
        return torch.zeros((), device=grad_out.device), dx, None


class WeightPass:
    """Cuts the cuttable layers of ``modules`` while a forward runs inside ``begin``/``end``;
    ``run(key)`` is that forward's ``W`` pass. Outside, the layers run as usual."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._key: Key | None = None
        self._anchor: torch.Tensor | None = None
        self._inputs: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[Key, list[tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {}
        self._handles = []
        for module in modules:
            if cuttable(module):
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post))

    def begin(self, key: Key) -> torch.Tensor:
        """Cut layers during the forward of ``key``; returns the tensor the ``I`` pass must
        ask a gradient for (it reaches every cut)."""
        self._key = key
        self._anchor = torch.zeros((), requires_grad=True)
        self._pending[key] = []
        return self._anchor

    def end(self) -> None:
        self._key = self._anchor = None

    def run(self, key: Key) -> Iterator[tuple[nn.Parameter, torch.Tensor | None]]:
        """(parameter, gradient) pairs of ``key``'s weight pass; frees its graphs. One
        autograd call for every cut layer of the forward (a call per layer cost a zero-bubble
        step more than its weight gradients' arithmetic on small layers); a weight shared by
        two layers appears once, with both contributions."""
        outputs, grads_out, params, seen = [], [], [], set()
        for module, y, grad_out in self._pending.pop(key, ()):  # none: the forward was not cut
            outputs.append(y)
            grads_out.append(grad_out)
            for p in module.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        if not params:  # every cut layer was frozen after its forward
            return iter(())
        grads = torch.autograd.grad(outputs, params, grads_out, allow_unused=True)
        return zip(params, grads, strict=True)

    def _pre(self, module: nn.Module, args: tuple) -> tuple | None:
        if self._key is None or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            self._inputs.setdefault(id(module), []).append(None)
            return None
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            self._inputs.setdefault(id(module), []).append(None)  # frozen: nothing for W
            return None
        x = args[0]
        cut = x.detach().requires_grad_(x.requires_grad)
        self._inputs.setdefault(id(module), []).append((x, cut))
        return (cut,)

    def _post(self, module: nn.Module, args: tuple, out: Any) -> Any:
        pair = self._inputs[id(module)].pop()
        if pair is None:
            return None
        x, cut = pair
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returned {type(out).__name__}")
        anchor = self._anchor.to(out.device) if self._anchor.device != out.device else self._anchor
        record = [module, out, cut, self._pending[self._key]]
        return _Cut.apply(anchor, x, record)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
