"""Rules about starting the process group and learning this process's local rank."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..analysis.astutil import dotted, keyword, last_name
from ..findings import Hit, Severity, rule
from ..script import Script
from .common import assigned_name, init_calls

INIT_FIX = (
    "Call init_process_group exactly once, before anything else distributed (or guard it with "
    "`if not dist.is_initialized():`); rankwise's `rw.init()` is idempotent."
)


def _events(s: Script, direct: list[ast.Call]) -> list[tuple[ast.Call, ast.Call]]:
    """(call site, the direct call it leads to): direct calls plus calls of local functions
    that contain one (``setup()`` calling init_process_group)."""
    out = [(c, c) for c in direct]
    holder: dict[ast.AST, ast.Call] = {}  # function -> a direct call inside it
    for d in direct:
        for a in s.ancestors(d):
            holder.setdefault(a, d)
    for c in s.calls:
        f = s.function_called(c)
        if f is None:
            continue
        found = next((holder[g] for g in (f, *s.local_callees(f)) if g in holder), None)
        if found is not None:
            out.append((c, found))
    return sorted(out, key=lambda e: (e[0].lineno, e[0].col_offset))


def _via(site: ast.Call, direct: ast.Call) -> str:
    return "" if site is direct else f" (through `{dotted(site.func)}()`, line {direct.lineno})"


@rule(
    "RW002",
    "init-process-group-twice",
    Severity.ERROR,
    "init_process_group called twice or inside a loop",
)
def init_process_group_twice(s: Script) -> Iterator[Hit]:
    destroys = [c for c in s.calls if last_name(c.func) == "destroy_process_group"]
    inits = _events(s, init_calls(s))
    ends = _events(s, destroys)
    msg = "RuntimeError: trying to initialize the default process group twice!"
    for i, (site, direct) in enumerate(inits):
        ctx = s.ctx[site]
        if ctx.init_guarded:
            continue
        if ctx.loops:
            loop = ctx.loops[-1]
            if not any(e in set(ast.walk(loop)) for e, _ in ends):
                yield (
                    site,
                    f"init_process_group runs inside the loop at line {loop.lineno}"
                    f"{_via(site, direct)}: its second iteration raises '{msg}'.",
                    INIT_FIX,
                )
            continue
        for prev, _ in inits[:i]:
            same_scope = s.scope_of[prev] is s.scope_of[site]
            torn_down = any(prev.lineno < e.lineno < site.lineno for e, _ in ends)
            if same_scope and not torn_down and not s.exclusive(prev, site):
                yield (
                    site,
                    f"init_process_group is called again here{_via(site, direct)}; it already "
                    f"ran at line {prev.lineno}. The second call raises '{msg}'.",
                    INIT_FIX,
                )
                break


def _local_rank_options(s: Script) -> Iterator[tuple[ast.Call, str]]:
    for c in s.calls:
        if not (isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"):
            continue
        flags = [a.value for a in c.args if isinstance(a, ast.Constant)]
        if "--local_rank" in flags or "--local-rank" in flags:
            dest = keyword(c, "dest")
            yield (
                c,
                dest.value.value
                if dest and isinstance(dest.value, ast.Constant)
                else ("local_rank"),
            )


def _runtime_names(s: Script) -> set[str]:
    """Names bound to rankwise objects (``rt = rw.init()``): their .local_rank is fine."""
    out = set()
    for c in s.calls:
        if s.is_rankwise(c.func) and (name := assigned_name(s, c)):
            out.add(name)
    return out


@rule(
    "RW010",
    "local-rank-without-env",
    Severity.ERROR,
    "--local_rank read from argparse with no LOCAL_RANK environment fallback",
)
def local_rank_without_env(s: Script) -> Iterator[Hit]:
    if any(isinstance(n, ast.Constant) and n.value == "LOCAL_RANK" for n in s.nodes):
        return
    runtime = _runtime_names(s)
    for option, dest in _local_rank_options(s):
        used = any(
            isinstance(n, ast.Attribute)
            and n.attr == dest
            and isinstance(n.ctx, ast.Load)
            and dotted(n.value) not in runtime
            for n in s.nodes
        )
        if not used:
            continue  # accepted only so the launcher's flag does not break parsing
        yield (
            option,
            f"`{s.snippet(option)}` is the only source of the local rank: torchrun (and "
            "`torch.distributed.launch --use-env`) pass it only in the LOCAL_RANK environment "
            "variable, and torch>=2.0's launch spells the flag `--local-rank`, so the value "
            "stays at its default and every process picks the same device.",
            "Read the environment too: `parser.add_argument('--local_rank', '--local-rank', "
            "type=int, default=int(os.environ.get('LOCAL_RANK', 0)))`, or use `rt = rw.init()` "
            "and `rt.local_rank`.",
        )
