"""Cut a model whose repeated blocks sit in a ``ModuleList`` (or ``nn.Sequential``) into stages.

``plan(model, num_stages)`` finds the blocks (the container of two or more blocks of one class
holding the most parameters: a transformer's layers) and sorts every other submodule by where
it is registered: before the container (the embeddings: the first stage's), or after it (the
final norm, the head: the last stage's). The blocks are balanced over the stages by parameter
count, the first stage's count including what comes before the blocks and the last stage's
what comes after. A plain ``nn.Sequential`` model is its own container.

``localize(model, plan, stages)`` then keeps, in place, only what this rank's stages hold:
the blocks container becomes a ``StageBlocks`` holding this rank's blocks under their own
names (``state_dict`` keys stay the unsplit model's), and the modules before or after the
blocks that another rank holds become ``Absent`` placeholders. The model's own ``forward``
still runs on the first stage (up to the blocks: ``StageBlocks`` stops it there) and on the
last (from the blocks on: ``StageBlocks`` hands it the last block's output), so the code
around the blocks (position embeddings, the loss) is the model's own.

On the last stage the code before the blocks runs too, on placeholders that return a zero
0-dim tensor: keep it to element-wise arithmetic (``wte(idx) + wpe(pos)``, dropout), and call
the blocks as ``for block in self.blocks: x = block(x)`` (or ``self.blocks(x)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .partition import balance_by_weight


@dataclass(frozen=True)
class SplitPlan:
    """Where the model is cut (names are dotted paths in the unsplit model)."""

    container: str
    """The blocks' container ('' when the model is a plain ``nn.Sequential``)."""
    blocks: tuple[str, ...]
    """The blocks' names inside the container, in order."""
    bounds: tuple[int, ...]
    """Stage ``s`` holds blocks ``bounds[s]`` to ``bounds[s + 1] - 1``."""
    pre: tuple[str, ...]
    """Modules that run before the blocks: the first stage's."""
    post: tuple[str, ...]
    """Modules that run after the blocks: the last stage's."""

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def blocks_of(self, stage: int) -> list[str]:
        return list(self.blocks[self.bounds[stage] : self.bounds[stage + 1]])


def _is_plain_sequential(model: nn.Module) -> bool:
    return isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward


def find_container(model: nn.Module) -> str:
    """The dotted name of the blocks' container; an error naming the model when none."""
    if _is_plain_sequential(model):
        return ""
    best, size = None, -1
    for name, module in model.named_modules():
        children = list(module.children())
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(children) < 2:
            continue
        if len({type(c) for c in children}) != 1 or not name:
            continue
        count = sum(p.numel() for p in module.parameters())
        if count > size:
            best, size = name, count
    if best is None:
        raise ConfigError(
            f"rt.prepare cannot cut {type(model).__name__} into pipeline stages: it has no "
            "ModuleList (or nn.Sequential) of two or more blocks of one class",
            fix="keep the repeated blocks in an nn.ModuleList (for block in self.blocks: "
            "x = block(x)), or write the model as an nn.Sequential.",
        )
    return best


def _side_modules(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """(before, after): the children of each module on the way to the container, sorted by
    their registration order relative to the way."""
    pre, post, node, prefix = [], [], model, ""
    for part in container.split("."):
        if any(True for _ in node.parameters(recurse=False)):
            names = [n for n, _ in node.named_parameters(recurse=False)]
            raise ConfigError(
                f"{type(node).__name__} holds parameters {names} itself, beside the blocks of "
                f"{container!r}: a pipeline stage holds whole submodules",
                fix="move them into a submodule (e.g. an nn.Embedding or a small nn.Module).",
            )
        side = pre
        for name, _child in node.named_children():
            if name == part:
                side = post
            else:
                side.append(prefix + name)
        node, prefix = getattr(node, part), prefix + part + "."
    return pre, post


def _unique_numel(modules: list[nn.Module]) -> int:
    seen = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(seen.values())


def plan(model: nn.Module, num_stages: int) -> SplitPlan:
    """Where to cut ``model`` into ``num_stages`` stages, balanced by parameter count."""
    container = find_container(model)
    box = model.get_submodule(container) if container else model
    blocks = [name for name, _ in box.named_children()]
    pre, post = _side_modules(model, container) if container else ([], [])
    if len(blocks) < num_stages:
        raise ConfigError(
            f"{type(model).__name__} has {len(blocks)} blocks in {container or 'itself'!r}, "
            f"fewer than the {num_stages} pipeline stages asked for",
            fix="use fewer pipeline stages (mesh pipeline size x stages_per_rank) or a model "
            "with more blocks.",
        )
    weights = [1 + _unique_numel([box.get_submodule(b)]) for b in blocks]
    weights[0] += _unique_numel([model.get_submodule(n) for n in pre])
    weights[-1] += _unique_numel([model.get_submodule(n) for n in post])
    sizes = balance_by_weight(weights, num_stages)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return SplitPlan(container, tuple(blocks), tuple(bounds), tuple(pre), tuple(post))


class AtBlocks(Exception):
    """Raised by ``StageBlocks`` on the first stage: the model's code up to the blocks is done;
    ``x`` is what it would give the first block."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__("pipeline: stopped at the blocks")
        self.x = x


class StageBlocks(nn.Module):
    """The blocks this rank holds, in place of the model's container (module names kept).

    ``run(stage, x)``: a stage's blocks in order. Called by the model's own forward (once per
    forward, with one tensor): in mode ``"pre"`` it stops the forward with ``AtBlocks``; in
    mode ``"post"`` it returns ``inject`` (the last stage's blocks' output).
    """

    def __init__(self, blocks: dict[str, nn.Module], stages: dict[int, list[str]]) -> None:
        super().__init__()
        for name, block in blocks.items():
            self.add_module(name, block)
        self.stage_blocks = stages
        self.mode: str | None = None
        self.inject: torch.Tensor | None = None
        self.calls = 0

    def run(self, stage: int, x: Any) -> Any:
        for name in self.stage_blocks[stage]:
            x = self._modules[name](x)
        return x

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if args or kwargs or not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"the model calls its pipeline blocks with {1 + len(args)} argument(s) "
                f"{sorted(kwargs) if kwargs else ''}; blocks cut into pipeline stages take one "
                "tensor and return one",
                fix="fold extra inputs into the blocks (e.g. a mask built inside), or split the "
                "model by hand with rw.DistributedPipeline.",
            )
        if self.mode == "pre":
            raise AtBlocks(x)
        if self.mode == "post":
            return self.inject
        raise ConfigError(
            "a pipelined model's blocks were called outside its pipeline step",
            fix="call the prepared model itself (model(x, y)), not its submodules.",
        )

    def __iter__(self) -> Iterator[nn.Module]:
        yield self  # `for block in self.blocks: x = block(x)` calls forward once

    def __getitem__(self, index: Any) -> nn.Module:
        raise ConfigError(
            f"the model indexes its pipeline blocks (blocks[{index!r}]); each rank holds only "
            "its stages' blocks",
            fix="iterate them instead: for block in self.blocks: x = block(x).",
        )


class Absent(nn.Module):
    """A module another pipeline stage holds: returns a zero 0-dim tensor (on ``device``)."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__()
        self.held_elsewhere, self.device = name, device

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), device=self.device)

    def extra_repr(self) -> str:
        return f"{self.held_elsewhere!r} is held by another pipeline stage"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    (model.get_submodule(parent) if parent else model)._modules[leaf] = new


def localize(model: nn.Module, plan: SplitPlan, stages: list[int], device: torch.device) -> StageBlocks | None:
    """Keep (in place) only what ``stages`` hold; return the container's replacement (None
    for a plain ``nn.Sequential``, whose other layers are dropped from it)."""
    last = plan.num_stages - 1
    mine = {s: plan.blocks_of(s) for s in stages}
    held = {b for names in mine.values() for b in names}
    for names, owner in ((plan.pre, 0), (plan.post, last)):
        for name in names:
            module = model.get_submodule(name)
            has_state = any(True for _ in module.parameters()) or any(True for _ in module.buffers())
            if owner not in stages and has_state:
                _replace(model, name, Absent(name, device))
    if not plan.container:
        for name in plan.blocks:
            if name not in held:
                del model._modules[name]
        return None
    box = model.get_submodule(plan.container)
    runner = StageBlocks({b: box.get_submodule(b) for b in plan.blocks if b in held}, mine)
    _replace(model, plan.container, runner)
    return runner
