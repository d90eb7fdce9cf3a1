"""``tensor_parallel(model, plan, group)``: split an existing model's layers over a group.

A plan maps module names (glob patterns, matched one dotted segment at a time: ``*`` never
crosses a dot) to a style:

    plan = {
        "wte": "vocab",                           # VocabParallelEmbedding
        "blocks.*.attn.qkv": Column(chunks=3),   # fused [q; k; v]: each rank its heads of each
        "blocks.*.attn.proj": "row",
        "blocks.*.mlp.fc": "column",
        "blocks.*.mlp.proj": "row",
        "lm_head": "column",                      # local logits: vocab_parallel_cross_entropy
    }

Attention heads: after the split each rank computes ``n_head / size`` heads. An attention
that reads the head count from its input (``q.view(B, T, -1, head_dim)``, and
``y.reshape(B, T, -1)`` before the output projection; see ``tiny_gpt``) runs unchanged. One
that stores it (``self.n_head``, ``self.n_embd``) gets it divided by a ``Divide`` entry:
``"blocks.*.attn": Divide("n_head", "n_embd")``.

Styles are applied in the plan's order; a pattern that matches nothing is an error (a typo
would otherwise leave a layer whole and silently replicated). Weights shared by two modules
(tied embedding and head) stay shared. No communication: every rank slices its own part
from the same full weights, so build (or load) the model identically on every rank first — or
build it under ``torch.device("meta")``: each layer then keeps the meta module it was cut
from, and ``rt.prepare`` initialises that module whole and cuts this rank's piece
(``parallel/deferred``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from ... import validate
from ...errors import ConfigError
from .layers import ColumnParallelLinear, Memo, RowParallelLinear, VocabParallelEmbedding
from .shards import Group, group_size

__all__ = ["Column", "Divide", "Row", "Vocab", "sync_replicated_grads", "tensor_parallel"]


def _expect(module: nn.Module, kind: type, name: str, style: str) -> None:
    if not isinstance(module, kind):
        raise ConfigError(
            f"plan entry {name!r}: {style!r} splits an nn.{kind.__name__}, but {name} is a "
            f"{type(module).__name__}",
            fix=f"point {style!r} at an nn.{kind.__name__}, or use Divide(...) for attributes.",
        )


@dataclass(frozen=True)
class Column:
    """Column-parallel (output features split); ``chunks=3`` for a fused q/k/v projection."""

    chunks: int = 1
    gather_output: bool = False

    def apply(self, module, name, group, memo, sequence_parallel):
        _expect(module, nn.Linear, name, "column")
        return ColumnParallelLinear(
            module, group, chunks=self.chunks, gather_output=self.gather_output,
            sequence_parallel=sequence_parallel, memo=memo,
        )  # fmt: skip


@dataclass(frozen=True)
class Row:
    """Row-parallel (input features split); the input is a column layer's local output."""

    input_is_parallel: bool = True

    def apply(self, module, name, group, memo, sequence_parallel):
        _expect(module, nn.Linear, name, "row")
        return RowParallelLinear(
            module, group, input_is_parallel=self.input_is_parallel,
            sequence_parallel=sequence_parallel, memo=memo,
        )  # fmt: skip


@dataclass(frozen=True)
class Vocab:
    """Vocabulary-parallel embedding (rows split)."""

    def apply(self, module, name, group, memo, sequence_parallel):
        _expect(module, nn.Embedding, name, "vocab")
        return VocabParallelEmbedding(module, group, sequence_parallel=sequence_parallel, memo=memo)


class Divide:
    """Divide integer attributes (``n_head``, ``n_embd``) by the group size, in place."""

    def __init__(self, *attrs: str) -> None:
        self.attrs = attrs

    def apply(self, module, name, group, memo, sequence_parallel):
        size = group_size(group)
        for attr in self.attrs:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or value % size:
                raise ConfigError(
                    f"plan entry {name!r}: Divide({attr!r}) needs an integer attribute that "
                    f"{size} rank(s) divide, got {name}.{attr}={value!r}",
                    fix=f"choose a tensor size that divides {attr}, or remove {attr!r}.",
                )
            setattr(module, attr, value // size)
        return module

    def __repr__(self) -> str:
        return f"Divide({', '.join(map(repr, self.attrs))})"


_NAMED = {"column": Column(), "row": Row(), "vocab": Vocab()}


def _style(pattern: str, style):
    if isinstance(style, str) and style in _NAMED:
        return _NAMED[style]
    if hasattr(style, "apply"):
        return style
    raise ConfigError(
        f"plan entry {pattern!r}: style {style!r} is not one of 'column', 'row', 'vocab'",
        fix="use 'column', 'row', 'vocab', Column(chunks=...), Row(), Vocab() or Divide(...).",
    )


def _matches(pattern: str, name: str) -> bool:
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(map(fnmatchcase, have, want))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def tensor_parallel(
    model: nn.Module,
    plan: Mapping[str, object],
    group: Group = None,
    *,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Replace the modules ``plan`` names by their tensor-parallel form over ``group``, in
    place; returns ``model``. ``group``: the tensor dimension's group (``mesh.group("tensor")``);
    None: every rank. No sync point (each rank slices its own part).
    """
    validate.module("model", model, where="rw.tensor_parallel()")
    validate.mapping("plan", plan, "a dict of module names to styles", where="rw.tensor_parallel()",
                     example="{'blocks.*.attn.qkv': Column(chunks=3), 'blocks.*.attn.proj': 'row'}")
    validate.process_group("group", group, where="rw.tensor_parallel()")
    if isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "reducer"):
        raise ConfigError(
            f"tensor_parallel got a {type(model).__name__}: split the bare model first",
            fix="call rw.tensor_parallel(model, ...) first, then wrap it in DDP/ZeRO over the "
            "data group.",
        )
    memo: Memo = {}
    for pattern, raw in plan.items():
        style = _style(pattern, raw)
        names = [n for n, _ in model.named_modules() if n and _matches(pattern, n)]
        if not names:
            some = [n for n, _ in model.named_modules() if n][:8]
            raise ConfigError(
                f"plan entry {pattern!r} matches no module of {type(model).__name__} "
                f"(modules: {', '.join(some)} ...)",
                fix="write the dotted module name as model.named_modules() spells it; '*' "
                "matches one segment (blocks.*.attn.qkv).",
            )
        for name in names:
            module = model.get_submodule(name)
            new = style.apply(module, name, group, memo, sequence_parallel)
            if new is not module:
                _replace(model, name, new)
    return model


def sync_replicated_grads(model: nn.Module, group: Group = None) -> None:
    """Sum over ``group`` the gradients of the parameters every rank holds whole (layer norms,
    row biases). Needed only with ``sequence_parallel=True``, where each rank saw a slice of
    the tokens; call it after ``backward()``, before ``step()`` (sums commute with the data-parallel mean).
    Sync point: the ranks of ``group``.
    """
    import torch.distributed as dist

    split = {id(getattr(m, n)) for m in model.modules() if hasattr(m, "tp_splits")
             for n in m.tp_splits()}  # fmt: skip
    if group_size(group) == 1:
        return
    for p in model.parameters():
        if id(p) not in split and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
