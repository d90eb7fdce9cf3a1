"""The recipes of docs/recipes.md, small: models, data and the two loops (imported by the ranks).

Each recipe is a real model as its users build it, with the optimizer its users pick:
a HF ``transformers`` GPT-2 from a config and a nanoGPT-style GPT (AdamW with a decay and a
no-decay group), a ResNet-18-shaped net (SGD with momentum and weight decay; torchvision's own
ResNet-18 too where torchvision imports). Every run trains STEPS optimizer steps of ACCUM
micro-batches under bf16-mixed with gradient clipping, and records every micro-batch's loss,
then the loss of its first batch after training (which checks the last update too).

``ours`` is the user's loop through the one-call API; ``peer`` is the same loop written for
torch's DDP or FSDP2 (``fully_shard`` per block, then the root), on the same per-rank batches.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

import rankwise as rw
from rankwise.models import GPT, GPTConfig, param_groups, resnet18

STEPS, ACCUM, GLOBAL_BATCH, CLIP = 3, 2, 8, 0.05
"""CLIP engages: the pre-clip norm is above it on every step of every recipe (asserted from the
norms each run returns)."""
SAMPLES = STEPS * ACCUM * GLOBAL_BATCH
VOCAB, SEQ = 64, 16


@dataclass(frozen=True)
class Recipe:
    build: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    data: Callable[[], TensorDataset]
    loss: Callable[[nn.Module, list[torch.Tensor]], torch.Tensor]
    """The forward and the loss; ``.mean()`` of the per-replica losses DataParallel gathers."""
    blocks: Callable[[nn.Module], list[nn.Module]]
    """FSDP2's units below the root: one per transformer or residual block."""


def _tokens() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g))


def _images() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 3, 16, 16, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (SAMPLES,), generator=g))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=3e-3)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return resnet18(num_classes=10, width=8)


def _torchvision_resnet18() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _hf_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss.mean()


def _gpt_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    (ids,) = batch
    return model(ids[:, :-1], ids[:, 1:])[1].mean()


def _image_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _residual_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in ("BasicBlock", "Bottleneck")]


RECIPES: dict[str, Recipe] = {
    "hf-gpt2": Recipe(_hf_gpt2, _adamw, _tokens, _hf_loss, lambda m: list(m.transformer.h)),
    "nanogpt": Recipe(_nanogpt, _adamw, _tokens, _gpt_loss, lambda m: list(m.blocks)),
    "resnet18": Recipe(_resnet, _sgd, _images, _image_loss, _residual_blocks),
    "torchvision-resnet18": Recipe(
        _torchvision_resnet18, _sgd, _images, _image_loss, _residual_blocks
    ),
}
STRATEGIES = ("ddp", "zero2", "zero3", "dp")
PEERS = ("torch-ddp", "torch-fsdp2")


def usable(name: str) -> str | None:
    """None when the recipe's library imports here, else why not (the test skips with it)."""
    try:
        if name == "hf-gpt2":
            from transformers import GPT2LMHeadModel  # noqa: F401
        elif name == "torchvision-resnet18":
            import torchvision  # noqa: F401
    except Exception as exc:  # a broken install raises more than ImportError
        library = "transformers" if name == "hf-gpt2" else "torchvision"
        return f"{name} needs a working {library}: {exc}"
    return None


def _to_dp_order(ds: TensorDataset, world: int) -> Subset:
    """DataParallel splits each global batch into contiguous chunks, DDP's sampler deals
    samples round-robin: reorder so that replica r's chunk is DDP rank r's batch."""
    per = GLOBAL_BATCH // world
    order = [g + r + world * i for g in range(0, len(ds), GLOBAL_BATCH)
             for r in range(world) for i in range(per)]  # fmt: skip
    return Subset(ds, order)


def ours(strategy: str, name: str) -> dict[str, Any]:
    """The user's loop through ``rw.init``/``rt.prepare`` (the only line that changes is the
    strategy). Returns the micro-batch losses and the loss of the first batch after training."""
    recipe = RECIPES[name]
    dp = strategy == "dp"
    rt = rw.init(strategy=strategy, devices=["cpu", "cpu"] if dp else None,
                 precision="bf16-mixed")  # fmt: skip
    try:
        model = recipe.build()
        opt = recipe.optimizer(model)
        data = _to_dp_order(recipe.data(), 2) if dp else recipe.data()
        loader = DataLoader(data, batch_size=GLOBAL_BATCH)
        model, opt, loader = rt.prepare(model, opt, loader, global_batch_size=GLOBAL_BATCH)
        losses, norms, first = [], [], None
        for batch in loader:
            first = first if first is not None else batch
            with rt.accumulate(model, steps=ACCUM) as acc:
                loss = recipe.loss(model, batch)
                rt.backward(loss)  # the mean over the group: loss / ACCUM
                if acc.sync:
                    norms.append(float(rt.clip_grad_norm_(model, CLIP)))
                    opt.step()
                    opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            final = recipe.loss(model, first).item()
        return {"losses": losses, "final": final, "norms": norms}
    finally:
        rw.shutdown()  # leaves the process group (not ours to destroy) for the next case


def peer(kind: str, name: str) -> dict[str, Any]:
    """The same loop for torch's DDP or FSDP2, under ``torch.autocast`` (bf16)."""
    recipe = RECIPES[name]
    world = dist.get_world_size()
    model = recipe.build()
    if kind == "torch-ddp":
        wrapped: nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in recipe.blocks(model):
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = recipe.optimizer(model)
    data = recipe.data()
    sampler = DistributedSampler(data, shuffle=False)
    losses, norms, first = [], [], None
    for i, batch in enumerate(DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)):
        first = first if first is not None else batch
        sync = (i + 1) % ACCUM == 0
        if kind == "torch-ddp":
            ctx = contextlib.nullcontext() if sync else wrapped.no_sync()
        else:
            wrapped.set_requires_gradient_sync(sync)
            ctx = contextlib.nullcontext()
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = recipe.loss(wrapped, batch)
            (loss / ACCUM).backward()
        if sync:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        final = recipe.loss(wrapped, first).item()
    return {"losses": losses, "final": final, "norms": norms}


def _guarded(fn: Callable[[str, str], dict], kind: str, name: str) -> dict[str, Any]:
    """One case; a failure is recorded (with its traceback) so the other cases still run.
    The known failures raise on every rank alike, before any collective is left half-done."""
    try:
        return fn(kind, name)
    except Exception:
        return {"error": traceback.format_exc()}


def world2(names: list[str]) -> dict[str, dict[str, Any]]:
    """Every peer and every process strategy for ``names``, at world 2, in one job."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    for name in names:
        for kind in PEERS:
            out[f"{name}/{kind}"] = _guarded(peer, kind, name)
        for strategy in (s for s in STRATEGIES if s != "dp"):
            out[f"{name}/{strategy}"] = _guarded(ours, strategy, name)
    return out


def world1(names: list[str]) -> dict[str, dict[str, Any]]:
    """DataParallel over two CPU replicas in one process, for ``names``."""
    torch.set_num_threads(1)
    return {f"{name}/dp": _guarded(ours, "dp", name) for name in names}
