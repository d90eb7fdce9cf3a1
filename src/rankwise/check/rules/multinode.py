"""Rules for what breaks on the second machine: a global rank where a local one belongs.

On one machine RANK == LOCAL_RANK, so these scripts work until a second node joins: node 1's
rank 4 asks for ``cuda:4`` on a 4-GPU machine, two nodes both call themselves rank 0, or a
checkpoint guarded by ``local_rank == 0`` is written once per node.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from itertools import pairwise

from ..analysis.astutil import call_args, keyword, last_name
from ..analysis.guards import kinds_in, once_per_node, rank_kind
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import init_calls, is_ddp, is_distributed_script

DEVICE_SETTERS = frozenset({"set_device", "set_device_index"})


def _global(s: Script, e: ast.AST | None) -> ast.AST | None:
    """``e`` itself, an element of ``[e]``, or a part of ``f"cuda:{e}"`` that is a global rank."""
    if e is None:
        return None
    parts = e.elts if isinstance(e, ast.List | ast.Tuple) else [e]
    for p in parts:
        if isinstance(p, ast.JoinedStr):
            inner = [v.value for v in p.values if isinstance(v, ast.FormattedValue)]
            hit = next((v for v in inner if rank_kind(v, s) == "global"), None)
        else:
            hit = p if rank_kind(p, s) == "global" else None
        if hit is not None:
            return hit
    return None


def _device_arg(s: Script, c: ast.Call) -> ast.AST | None:
    """The argument of ``c`` that names a device, when ``c`` places something on one."""
    name = last_name(c.func)
    if isinstance(c.func, ast.Attribute) and name in ("to", "cuda") and c.args:
        return c.args[0]
    if name in DEVICE_SETTERS or (name == "device" and s.is_api(c.func, "device")):
        return c.args[-1] if c.args else None
    if is_ddp(s, c.func):
        for kw in ("device_ids", "output_device"):
            k = keyword(c, kw)
            if k is not None and _global(s, k.value) is not None:
                return k.value
    return None


@rule(
    "RW013",
    "global-rank-as-device",
    Severity.WARNING,
    "the global RANK used as a device index (.to(rank), device_ids=[rank], set_device(rank))",
)
def global_rank_as_device(s: Script) -> Iterator[Hit]:
    for c in s.calls:
        rank = _global(s, _device_arg(s, c))
        if rank is None:
            continue
        yield (
            c,
            f"`{s.snippet(c)}` uses the global rank `{s.snippet(rank)}` as a device index: it "
            "equals the local rank only on the first node; on node 1 of 2 x 4 GPUs, rank 4 asks "
            "for cuda:4 on a machine with cuda:0-3.",
            "Use the local rank: `int(os.environ['LOCAL_RANK'])` (or `rt.local_rank`, or "
            "`rt.device` from `rt = rw.init()`).",
        )


@rule(
    "RW014",
    "init-rank-from-local-rank",
    Severity.ERROR,
    "init_process_group(rank=...) given the LOCAL rank",
)
def init_rank_from_local_rank(s: Script) -> Iterator[Hit]:
    for c in init_calls(s):
        given = call_args(c, 4, "rank")  # init_process_group(backend, init_method, timeout, world_size, rank)
        if given is None or rank_kind(given, s) != "local":
            continue
        yield (
            c,
            f"`{s.snippet(c)}` passes the local rank `{s.snippet(given)}` as the process's "
            "global rank: on two nodes, both local rank 0s claim rank 0 and the rendezvous "
            "fails or hangs.",
            "Pass `rank=int(os.environ['RANK'])`, or leave `rank=` out under torchrun / "
            "rankwise run (env:// reads RANK).",
        )


@rule(
    "RW015",
    "save-guarded-by-local-rank",
    Severity.WARNING,
    "a checkpoint written under `if local_rank == 0:` (once per node)",
)
def save_guarded_by_local_rank(s: Script) -> Iterator[Hit]:
    if not is_distributed_script(s):
        return
    for c in s.calls:
        r = s.resolve(c.func)
        if not (r and r[1] and r[0] == "torch.save"):
            continue
        found = _local_guard(s, c)
        if found is None:
            continue
        test, line = found
        yield (
            c,
            f"`{s.snippet(c)}` runs under `{s.snippet(test)}` (line {line}): {_why(s, test)}"
            "so each node writes the file; on shared storage they write the same path at once.",
            "Guard with the global rank (`int(os.environ['RANK']) == 0`, `dist.get_rank() == 0`, "
            "`rt.is_master`), or use `rw.save_checkpoint(...)` on every rank.",
        )


def _if_tests(s: Script, node: ast.AST) -> list[ast.If]:
    """The ifs whose body (not else) holds ``node``, innermost first."""
    path = [node, *s.ancestors(node)]
    return [a for child, a in pairwise(path) if isinstance(a, ast.If) and child in a.body]


def _local_guard(s: Script, c: ast.Call) -> tuple[ast.AST, int] | None:
    """The local-rank-0 guard over ``c`` (and its line): around ``c``, or around every call of
    the function holding ``c`` (imagenet/main.py: ``save_checkpoint(...)`` under
    ``not args.multiprocessing_distributed or (... and args.rank % ngpus_per_node == 0)``)."""
    ctx = s.ctx[c]
    test = getattr(ctx.guard, "test", None)
    if ctx.polarity == 1 and test is not None and kinds_in(test, s) == {"local"}:
        return test, ctx.guard.lineno
    ifs = _if_tests(s, c)
    scope = s.scope_of.get(c)
    callers = [o for o in s.calls if scope is not s.tree and s.function_called(o) is scope]
    for call in callers:
        ifs.extend(_if_tests(s, call)[:1])
    for node in ifs:
        term = once_per_node(node.test, s)
        if term is not None:
            return term, node.lineno
    return None


def _why(s: Script, test: ast.AST) -> str:
    if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test)):
        return "a rank modulo the processes per node is the local rank, 0 once on every node, "
    return "local rank 0 exists on every node, "
