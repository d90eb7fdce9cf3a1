"""Rules about the training loop's state: mixed-precision scaling and resuming."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..analysis.astutil import dotted, last_name
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import is_ddp, is_distributed_script
from .ranks import TORCH_COLLECTIVES, runtimes

CLIPS = frozenset({"clip_grad_norm_", "clip_grad_value_"})
EXISTS = frozenset({"exists", "isfile", "is_file", "isdir", "is_dir"})
LOADS = frozenset({"load_checkpoint", "load_state_dict"})
AGREEMENT = TORCH_COLLECTIVES | {"broadcast_object", "all_reduce_mean"}


def _before_in_scope(s: Script, node: ast.AST, names: frozenset[str]) -> bool:
    """Is a call named one of ``names`` made earlier in the function that holds ``node``?"""
    scope = s.scope_of.get(node)
    return any(
        last_name(c.func) in names and s.scope_of.get(c) is scope and c.lineno < node.lineno
        for c in s.calls
    )


@rule(
    "RW016",
    "clip-before-unscale",
    Severity.ERROR,
    "gradients clipped while still multiplied by the GradScaler (no scaler.unscale_ first)",
)
def clip_before_unscale(s: Script) -> Iterator[Hit]:
    yield from _torch_clip_after_rt_backward(s)
    if not any(s.is_call_to(c, "GradScaler", unresolved=True) for c in s.calls):
        return
    for c in s.calls:
        if last_name(c.func) not in CLIPS or not _scaled_backward_before(s, c):
            continue
        yield (
            c,
            f"`{s.snippet(c)}` clips gradients that the GradScaler has multiplied by the loss "
            "scale (65536 at first): the threshold applies to the scaled norm, so every step "
            "is clipped far too hard, or not at all once the scale drops.",
            "Call `scaler.unscale_(optimizer)` after backward and before clipping; "
            "`scaler.step(optimizer)` then knows not to unscale twice.",
        )


def _fp16(s: Script) -> bool:
    return any(
        isinstance(n, ast.Constant) and n.value == "fp16-mixed" for n in ast.walk(s.tree)
    )


def _torch_clip_after_rt_backward(s: Script) -> Iterator[Hit]:
    """Under ``precision="fp16-mixed"``, ``rt.backward`` leaves the gradients scaled until
    ``opt.step()``: torch's clip between them sees the scaled norm (``rt.clip_grad_norm_``
    unscales first)."""
    rts = runtimes(s)
    if not rts or not _fp16(s):
        return
    for c in s.calls:
        if last_name(c.func) not in CLIPS or s.qualname(c.func) is None:
            continue
        if not s.qualname(c.func).startswith("torch.") or _unscaled_before(s, c):
            continue
        scope = s.scope_of.get(c)
        if not any(
            isinstance(b.func, ast.Attribute) and b.func.attr == "backward"
            and dotted(b.func.value) in rts and s.scope_of.get(b) is scope
            and b.lineno <= c.lineno
            for b in s.calls
        ):
            continue
        yield (
            c,
            f"`{s.snippet(c)}` clips gradients that `rt.backward` left multiplied by the loss "
            "scale (precision='fp16-mixed'): the threshold applies to the scaled norm, so every "
            "step is clipped far too hard.",
            "Use `rt.clip_grad_norm_(model, max_norm)`, which unscales first (or call "
            "`opt.unscale_()` before torch's clip).",
        )


def _unscaled_before(s: Script, clip: ast.Call) -> bool:
    scope = s.scope_of.get(clip)
    return any(
        last_name(c.func) == "unscale_" and s.scope_of.get(c) is scope and c.lineno <= clip.lineno
        for c in s.calls
    )


def _scaled_backward_before(s: Script, clip: ast.Call) -> bool:
    """A ``scaler.scale(loss)`` on the clip's path, with no ``unscale_`` between them."""
    scope = s.scope_of.get(clip)

    def on_path(c: ast.Call, name: str) -> bool:
        return (
            last_name(c.func) == name
            and s.scope_of.get(c) is scope
            and c.lineno <= clip.lineno
            and not s.exclusive(c, clip)  # not the other branch of `if use_amp: ... else:`
        )

    scales = [c.lineno for c in s.calls if on_path(c, "scale")]
    unscales = [c.lineno for c in s.calls if on_path(c, "unscale_")]
    return bool(scales) and not any(u >= max(scales) for u in unscales)


def _loads(s: Script, body: list[ast.stmt]) -> bool:
    """Does ``body`` (or a function it calls) load a checkpoint?"""
    for stmt in body:
        for part in (stmt, *s.local_callees(stmt)):
            for n in ast.walk(part):
                if isinstance(n, ast.Call) and (
                    s.qualname(n.func) == "torch.load" or last_name(n.func) in LOADS
                ):
                    return True
    return False


def _restores_state(s: Script, body: list[ast.stmt]) -> bool:
    """Does it read training state out of the checkpoint (``epoch = ckpt["epoch"]``)? DDP's
    constructor makes the model's parameters agree; it does not touch an epoch counter."""
    for stmt in body:
        for part in (stmt, *s.local_callees(stmt)):
            for n in ast.walk(part):
                if isinstance(n, ast.Assign) and any(  # epoch = ckpt["epoch"] (+ 1)
                    isinstance(x, ast.Subscript) for x in ast.walk(n.value)
                ):
                    return True
    return False


def _ddp_after(s: Script, node: ast.stmt) -> bool:
    scope = s.scope_of.get(node)
    return any(
        is_ddp(s, c.func) and s.scope_of.get(c) is scope and c.lineno > node.lineno
        for c in s.calls
    )


@rule(
    "RW017",
    "resume-decided-per-rank",
    Severity.WARNING,
    "resume decided on each rank from os.path.exists(checkpoint), without a barrier/broadcast",
)
def resume_decided_per_rank(s: Script) -> Iterator[Hit]:
    if not is_distributed_script(s):
        return
    for node in s.nodes:
        if not isinstance(node, ast.If) or s.ctx[node].polarity != 0:
            continue
        probe = next(
            (
                n
                for n in ast.walk(node.test)
                if isinstance(n, ast.Call) and last_name(n.func) in EXISTS
            ),
            None,
        )
        if probe is None or not _loads(s, node.body) or _before_in_scope(s, node, AGREEMENT):
            continue
        if _ddp_after(s, node) and not _restores_state(s, node.body):
            continue  # only the model is loaded, and DDP's constructor broadcasts rank 0's
        yield (
            node,
            f"Each rank decides on its own whether to resume (`if {s.snippet(node.test)}`): "
            "a node that does not see the file (local disk, or rank 0 still writing it) starts "
            "from scratch while the others resume, and the replicas silently diverge or hang.",
            "Decide once: check on rank 0 and `dist.broadcast_object_list([found], src=0)`, or "
            "`dist.barrier()` after the last save before any rank checks; "
            "`rw.load_checkpoint` agrees across ranks for you.",
        )
