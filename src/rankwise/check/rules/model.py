"""Rules about the model object: wrapping order, what gets saved, what gets loaded."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..analysis.astutil import call_args, dotted, keyword, last_name
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import assigned_name, contains_move, ddp_calls, dp_calls, is_move

WRAP_FIX = (
    "Move the model to its device first, then wrap it: `model = Net().to(device)`, then "
    "`model = DDP(model, device_ids=[local_rank], output_device=local_rank)` "
    "(with rankwise: `rw.DistributedDataParallel(Net().to(rt.device))`)."
)


def _gpu_signs(s: Script, ddp: ast.Call) -> bool:
    """Does the script aim at GPUs? A CPU/gloo script may wrap a model that never moves."""
    if keyword(ddp, "device_ids") or keyword(ddp, "output_device"):
        return True
    scope = s.scope_of[ddp]
    if any(isinstance(n, ast.Constant) and n.value == "gloo" for n in ast.walk(scope)):
        return False  # the wrapping code itself chose the CPU backend
    for n in s.nodes:
        text = n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else ""
        if text == "nccl" or text.startswith("cuda"):
            return True
        if isinstance(n, ast.Call) and (
            (isinstance(n.func, ast.Attribute) and n.func.attr == "cuda")
            or s.qualname(n.func) == "torch.cuda.set_device"
        ):
            return True
    return False


def _receiver(call: ast.Call) -> str | None:
    return dotted(call.func.value) if isinstance(call.func, ast.Attribute) else None


def _moved_before(s: Script, name: str, ddp: ast.Call) -> bool:
    scope = s.scope_of[ddp]
    for c in s.calls:
        if c.lineno >= ddp.lineno:
            break
        if is_move(c) and _receiver(c) == name and s.scope_of[c] is scope:
            return True
    for value in s.values(ast.Name(id=name, ctx=ast.Load()), ddp):
        if contains_move(value):
            return True
        # model = build_model()  where build_model moves it
        f = s.function_called(value) if isinstance(value, ast.Call) else None
        if f is not None and contains_move(f):
            return True
    return False


def _fresh_model(s: Script, value: ast.AST) -> bool:
    """Does ``value`` build a model on the CPU? A class (``Net()``, ``nn.Linear(...)``), a
    torchvision/timm factory, or one of the script's own functions that never moves it. Other
    factories (``create_model(args)``) may well move it: we cannot see inside, so we stay quiet."""
    if not isinstance(value, ast.Call):
        return False
    q = s.qualname(value.func) or ""
    if q.split(".")[0] in ("torchvision", "timm"):
        return True
    f = s.function_called(value)
    if f is not None:
        return not contains_move(f)
    return (last_name(value.func) or "")[:1].isupper()


def _moved_after(s: Script, ddp: ast.Call, names: list[str]) -> ast.Call | None:
    up = s.parent.get(ddp)
    if isinstance(up, ast.Attribute) and is_move(s.parent.get(up)):  # DDP(model).cuda()
        return s.parent[up]
    scope = s.scope_of[ddp]
    for c in s.calls:
        later = c.lineno > ddp.lineno and s.scope_of[c] is scope
        if later and is_move(c) and _receiver(c) in names:
            return c
    return None


@rule("RW001", "ddp-before-device", Severity.ERROR, "DDP wraps a model before it is on its device")
def ddp_before_device(s: Script) -> Iterator[Hit]:
    for ddp in ddp_calls(s):
        arg = call_args(ddp, 0, "module")
        if arg is None or contains_move(arg):
            continue
        name = dotted(arg)
        if name is not None and _moved_before(s, name, ddp):
            continue
        what = f"`{s.snippet(ddp.func)}` wraps `{s.snippet(arg)}` at line {ddp.lineno}"
        names = [n for n in (name, assigned_name(s, ddp)) if n]
        after = _moved_after(s, ddp, names)
        if after is not None:
            yield (
                ddp,
                f"{what}, but the model reaches its device only later (line {after.lineno}: "
                f"`{s.snippet(after)}`). DDP broadcasts and registers the parameters where they "
                "are when it is built: with device_ids torch fails with 'AssertionError: "
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device GPU modules ... {device(type='cpu')}'.",
                WRAP_FIX,
            )
        elif _gpu_signs(s, ddp) and (
            _fresh_model(s, arg)
            or (
                (name is not None and "." not in name)
                and any(_fresh_model(s, b.value) for b in s.reaching(name, ddp))
            )
        ):
            yield (
                ddp,
                f"{what}, and the model is never moved to a device before that, although this "
                "script targets GPUs (device_ids/cuda/nccl): DDP would wrap CPU parameters "
                "('... only work with single-device GPU modules ... {device(type='cpu')}').",
                WRAP_FIX,
            )


def _torch_wrapper(s: Script, owner: str, at: ast.AST) -> ast.Call | None:
    """The torch DDP/DP call ``owner`` may be bound to at ``at`` (rankwise's has no prefix)."""
    wrappers = {id(c) for c in (*ddp_calls(s), *dp_calls(s))}
    for b in s.reaching(owner, at):
        if id(b.value) in wrappers and not s.is_rankwise(b.value.func):
            return b.value
    return None


@rule(
    "RW006",
    "wrapped-state-dict-saved",
    Severity.WARNING,
    "torch.save of a DDP/DataParallel wrapper's state_dict (every key gets `module.`)",
)
def wrapped_state_dict_saved(s: Script) -> Iterator[Hit]:
    for save in s.calls:
        if s.qualname(save.func) != "torch.save" or not s.resolve(save.func)[1]:
            continue
        obj = call_args(save, 0, "obj")
        hit = _wrapped_state_dict(s, obj, save) if obj is not None else None
        if hit is None:
            continue
        owner, wrapper = hit
        yield (
            save,
            f"`{owner}` is a {s.snippet(wrapper.func)} wrapper (line {wrapper.lineno}), so "
            f"`{owner}.state_dict()` names every key `module.<name>`; loading the file into a bare "
            'model fails with \'Missing key(s) in state_dict: "conv1.weight" ... Unexpected '
            'key(s) in state_dict: "module.conv1.weight"\'.',
            f"Save `{owner}.module.state_dict()` (or strip the `module.` prefix before saving); "
            "rankwise's save_checkpoint stores prefix-free state.",
        )


def _wrapped_state_dict(s: Script, obj: ast.AST, at: ast.AST) -> tuple[str, ast.Call] | None:
    for value in s.values(obj, at):
        for n in ast.walk(value):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "state_dict"
                and (owner := dotted(n.func.value))
                and (wrapper := _torch_wrapper(s, owner, n if n in s.scope_of else at))
            ):
                return owner, wrapper
    return None


@rule(
    "RW011",
    "torch-load-without-weights-only",
    Severity.WARNING,
    "torch.load without weights_only=True can run arbitrary code from the file",
)
def torch_load_without_weights_only(s: Script) -> Iterator[Hit]:
    for c in s.calls:
        r = s.resolve(c.func)
        if not (r and r[1] and r[0] == "torch.load") or any(kw.arg is None for kw in c.keywords):
            continue
        kw = keyword(c, "weights_only")
        if kw is None:
            why = (
                "has no weights_only argument: before torch 2.6 the default is False, which "
                "unpickles (and can execute) anything in the file"
            )
        elif isinstance(kw.value, ast.Constant) and not kw.value.value:
            why = "sets weights_only=False, which unpickles (and can execute) anything in the file"
        else:
            continue
        yield (
            c,
            f"`{s.snippet(c)}` {why}.",
            "Pass `weights_only=True` (tensors, dicts, numbers only); keep extra state in plain "
            "types, or use rankwise's load_checkpoint.",
        )
